"""Flags of `tessera.estimate` and `tessera.plan` that are not config options: each declared once, with its doc,
parsed before the config's own flags; a bad one is one line naming it (exit status 2)."""

import contextlib
import dataclasses
import logging
import warnings
from typing import Any

from tessera.config import ConfigError
from tessera.estimate.cost import Cluster


@dataclasses.dataclass(frozen=True)
class Flag:
    kind: type  # int, float, str or bool (a bare flag)
    default: Any
    doc: str
    choices: tuple = ()
    positive: bool = True  # numbers must be > 0


GIB = 2**30
HEADROOM = 0.9  # the share of a GPU's memory a run may plan on: the rest is the allocator's and CUDA's
CLUSTER = {
    "gpus_per_node": Flag(int, 8, "GPUs per node: TP and EP groups up to this size stay on intra-node links"),
    "peak_tflops": Flag(float, 989.0, "a GPU's dense bf16 peak in TFLOP/s (H100/H200: 989, B200: 2250, A100: 312)"),
    "mfu": Flag(float, 0.4, "the share of that peak the step's matmuls reach (0 < mfu <= 1)"),
    "intra_gbps": Flag(float, 450.0, "GB/s per GPU between GPUs of a node (NVLink)"),
    "inter_gbps": Flag(float, 50.0, "GB/s per GPU between nodes (400 Gb/s NICs: 50)"),
    "inter_group_gbps": Flag(float, 12.5, "GB/s per GPU between fault-tolerance replica groups (another cluster or "
                                          "cloud: 100 Gb/s = 12.5): per-step groups against DiLoCo"),
}


def split(argv: list[str], flags: dict[str, Flag]) -> tuple[dict[str, Any], list[str]]:
    """(this command's flags, with defaults; the rest, for tessera.config's parser). `--name value`, `--name=value`,
    bare `--name` for a bool (or `--name false`); `-` and `_` alike in names."""
    values = {name: f.default for name, f in flags.items()}
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        name = key.replace("-", "_")
        if name not in flags:
            rest.append(arg)
            i += 1
            continue
        flag = flags[name]
        if flag.kind is bool and not eq:
            nxt = argv[i + 1].lower() if i + 1 < len(argv) else ""
            values[name], i = (nxt in ("true", "1"), i + 2) if nxt in ("true", "false", "1", "0") else (True, i + 1)
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key}: missing value ({flag.doc})")
            value, i = argv[i + 1], i + 1
        values[name] = _convert(key, value, flag)
        i += 1
    return values, rest


def _convert(key: str, value: str, flag: Flag) -> Any:
    try:
        if flag.kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        out = flag.kind(value)
    except ValueError:
        raise ConfigError(f"--{key}: expected {'a number' if flag.kind is float else 'an integer'}, got "
                          f"{value!r}") from None
    if flag.choices and out not in flag.choices:
        raise ConfigError(f"--{key}: {out!r} is not one of {', '.join(map(str, flag.choices))}")
    if flag.kind in (int, float) and flag.positive and not out > 0:
        raise ConfigError(f"--{key}: {out!r} must be positive")
    return out


def cluster(values: dict[str, Any]) -> Cluster:
    if values["mfu"] > 1:
        raise ConfigError(f"--mfu: {values['mfu']} is above 1; give the share of peak, e.g. 0.4")
    return Cluster(**{name: values[name] for name in CLUSTER})


def usage(command: str, flags: dict[str, Flag]) -> str:
    lines = [command, "", "Options:"]
    for name, f in flags.items():
        choices = f" {{{'|'.join(map(str, f.choices))}}}" if f.choices else ""
        lines.append(f"  --{name:<20} {f.doc} (default: {f.default!r}){choices}")
    return "\n".join(lines)


def help_asked(argv: list[str], doc: str, flags: dict[str, Flag]) -> bool:
    """`--help`: the command's line (its module doc's first sentence) and its options, printed."""
    if "--help" not in argv and "-h" not in argv:
        return False
    print(usage(doc.split(":", 1)[0] + " [options] [config flags]", flags))
    return True


@contextlib.contextmanager
def quiet():
    """Parallelism plans warn about a pipeline stage's missing modules, FSDP about views it returns: nothing the
    reader of an estimate acts on."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
