"""Every benchmark script runs end to end in its smoke mode (`--smoke`: tiny sizes, a few steps), so a refactor that
breaks one fails here rather than in the next benchmark run (issue 27, item 9). Scripts are found by glob: a new
`benchmarks/bench_*.py` or `check_*.py` is covered by adding its `--smoke`. GPU scripts run their pipeline on CPU
in smoke mode (a tiny model in fp32, no compilation)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/bench_*.py"), *ROOT.glob("benchmarks/check_*.py")])
STARTS_RANKS = {"bench_cp.py", "bench_moe.py", "bench_optim.py", "bench_trainer.py"}
PACED = {"bench_ft.py"}  # its failure runs sleep in every step (step_delay)


def _marks(script: Path) -> tuple:
    return (pytest.mark.ranks,) if script.name in STARTS_RANKS else (pytest.mark.paced,) if script.name in PACED else ()


@pytest.mark.parametrize("script", [pytest.param(s, id=s.name, marks=_marks(s)) for s in SCRIPTS])
def test_benchmark_runs_in_smoke_mode_and_writes_its_json(script, tmp_path):
    out = tmp_path / f"{script.stem}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # each script starts its own cold cache
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, f"{script.name} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result and result.get("smoke", True) is True, result


def test_summary_of_a_smoke_run_judges_no_target(tmp_path):
    (tmp_path / "trainer.json").write_text(json.dumps({"smoke": True, "tessera_over_plain": 0.5}))
    (tmp_path / "moe.json").write_text(json.dumps({"smoke": True, "layer": {"grouped_over_loop": 2.0}}))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/summary.py"), "--results", str(tmp_path)],
                          capture_output=True, text=True, check=True)
    assert "smoke run" in proc.stdout
    rows = {r["measure"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    assert rows["trainer / plain eager loop, tokens/s"]["value"] == 0.5
    assert {r["ok"] for r in rows.values()} == {""}  # 0.5 would be "NO" in a real run
    (tmp_path / "trainer.json").write_text(json.dumps({"tessera_over_plain": 0.5}))
    (tmp_path / "moe.json").unlink()
    subprocess.run([sys.executable, str(ROOT / "benchmarks/summary.py"), "--results", str(tmp_path)],
                   capture_output=True, text=True, check=True)
    assert json.loads((tmp_path / "summary.json").read_text())[0]["ok"] == "NO"


def test_run_all_smoke_runs_every_benchmark_in_smoke_size(tmp_path):
    """run_all.sh --smoke hands --smoke to every benchmark it runs (a stand-in python records the calls)."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n')
    fake.chmod(0o755)
    subprocess.run([str(ROOT / "benchmarks/run_all.sh"), "--smoke"], env={**os.environ, "PYTHON": str(fake),
                   "OUT": str(tmp_path)}, check=True, capture_output=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    benches = [c for c in calls if "/bench_" in c]
    assert {c.split()[0].rsplit("/", 1)[1] for c in benches} >= {"bench_trainer.py", "bench_optim.py"}
    assert all("--smoke" in c.split() for c in benches), benches
    assert not any("--docs" in c for c in calls)


def test_summary_docs_table_is_regenerated_from_the_results(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n\nintro\n<!-- benchmarks/summary.py --docs: begin -->\n| old | 0.75 |\n"
                    "<!-- benchmarks/summary.py --docs: end -->\n\nafter\n")
    (tmp_path / "trainer.json").write_text(json.dumps({"smoke": True, "fsdp": {"scaling_efficiency": 0.5}}))
    summary = [sys.executable, str(ROOT / "benchmarks/summary.py"), "--results", str(tmp_path), "--docs", str(page)]
    refused = subprocess.run(summary, capture_output=True, text=True)
    assert refused.returncode == 2 and "a smoke run measures nothing" in refused.stderr
    (tmp_path / "trainer.json").write_text(json.dumps({"fsdp": {"scaling_efficiency": 0.912}}))
    subprocess.run(summary, capture_output=True, text=True, check=True)
    text = page.read_text()
    assert text.startswith("# B\n\nintro\n<!-- benchmarks/summary.py --docs: begin -->\nCPU figures of ")
    assert "| FSDP 2 ranks / (2 x 1 rank), 1 thread | 0.912 | report (1.0 linear) |  |" in text
    assert "| old |" not in text and text.endswith("<!-- benchmarks/summary.py --docs: end -->\n\nafter\n")
    shipped = (ROOT / "docs/benchmarks.md").read_text()
    assert "<!-- benchmarks/summary.py --docs: begin -->" in shipped and "summary.py --docs: end -->" in shipped


def _gpu_suite():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu
    import gpu_titan
    return bench_gpu, gpu_titan


def test_gpu_suite_runs_3b_with_every_peer_first_then_1b_then_float8():
    bench_gpu, _ = _gpu_suite()
    a = bench_gpu.argparse.Namespace(flavors="3B,1B", peers="tessera,plain,torchtitan,hf",
                                     configs="bf16,compile,compile_float8_rowwise,compile_float8_tensorwise")
    runs = bench_gpu.plan(a)
    assert len(runs) == 32 and len(set(runs)) == 32
    assert runs[:8] == [(p, "3B", c) for c in ("bf16", "compile") for p in ("tessera", "plain", "torchtitan", "hf")]
    assert {f for _, f, _ in runs[8:16]} == {"1B"} and {c for _, _, c in runs[:16]} == {"bf16", "compile"}
    assert runs[16:20] == [(p, "3B", "compile_float8_rowwise") for p in ("tessera", "plain", "torchtitan", "hf")]


def test_torchtitan_log_gives_median_tokens_per_s_after_warmup_and_peak_memory():
    _, gpu_titan = _gpu_suite()
    log = "\n".join(f"[titan] 2026-12-04 - root - INFO - step: {s:2}  loss: 12.00000  grad_norm: 1.0000  memory: "
                    f"{mem:5.2f}GiB(50.00%)  tps: {tps:,}  tflops: 1.00  mfu: 0.10%"
                    for s, mem, tps in [(1, 80.0, 1_000), (2, 90.5, 20_000), (3, 90.0, 30_000), (4, 90.0, 10_000),
                                        (5, 91.25, 40_000)])
    res = gpu_titan.read_log(log, warmup=2, tokens_per_step=8192)
    assert res["tokens_per_s"] == 30_000  # the median of steps 3-5
    assert res["peak_memory_gib"] == 91.25 and res["first_step_s"] == 8.192
    assert gpu_titan.read_log(log, warmup=5, tokens_per_step=8192)["status"].startswith("failed")


@pytest.mark.fast
def test_torchtitan_peer_trains_tesseras_llama3_sizes_with_the_configs_flags():
    """TorchTitan 0.2.2 has no Llama 3 1B/3B: gpu_titan adds them from Tessera's table; the sizes must be those of
    the model the other peers train (transformers' config of it), the FFN width by TorchTitan's FeedForward rule."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_peers
    import gpu_titan

    from tessera.models.llama3.args import FLAVORS
    from tessera.models.llama3.hf import hf_config

    for flavor in ("1B", "3B"):
        t, hf = gpu_titan.titan_model_args(flavor), hf_config(FLAVORS[flavor])
        hidden = int(t["ffn_dim_multiplier"] * int(2 * 4 * t["dim"] / 3))
        hidden = t["multiple_of"] * -(-hidden // t["multiple_of"])
        assert (t["dim"], t["n_layers"], t["n_heads"], t["n_kv_heads"], t["vocab_size"], hidden, t["rope_theta"],
                t["rope_scaling"]["scaling_factor"]) == \
            (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
             hf["vocab_size"], hf["intermediate_size"], hf["rope_theta"], hf["rope_parameters"]["factor"])
    run = {"flavor": "3B", "seq_len": 8192, "batch": 1, "steps": 9, "compile": True, "float8": "tensorwise",
           "assets": "a", "data": "d", "dump": "o"}
    flags = gpu_titan.titan_flags(run)
    values = dict(zip(flags, flags[1:], strict=False))
    assert values["--model.flavor"] == "3B" and values["--training.seq_len"] == "8192"
    assert values["--quantize.linear.float8.recipe_name"] == "tensorwise" and "--compile.enable" in flags
    assert values["--quantize.linear.float8.filter_fqns"] == "output"
    assert "--compile.enable" not in gpu_titan.titan_flags({**run, "compile": False, "float8": None})
    assert gpu_peers.titan_refusal("compile_float8_tensorwise", "3B") is None  # 0.2.2 has tensorwise
    assert "no Llama 3 flavor" in gpu_peers.titan_refusal("bf16", "tiny")


@pytest.mark.fast
def test_gpu_moe_keeps_what_a_run_cut_short_measured_and_its_ratios():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu_moe

    lines = [["layer", {"dim": 2048}], ["tessera_grouped", {"status": "ok", "tokens_per_s": 300.0, "peak_gib": 1.0}],
             ["loop", {"status": "ok", "tokens_per_s": 100.0, "peak_gib": 2.0}]]
    text = "\n".join(bench_gpu_moe.TAG + json.dumps(x) for x in lines) + "\ncompiling torchtitan_float8..."
    cut = bench_gpu_moe.read_child(None, text, 120)  # killed at its time limit
    assert cut["status"] == "timeout after 120s" and cut["loop"]["tokens_per_s"] == 100.0
    line = bench_gpu_moe.layer_line("qwen3_30b_a3b", cut)
    assert cut["tessera_grouped_over_loop"] == 3.0 and "grouped/loop 3.00x" in line
    assert "tessera_grouped_over_torchtitan" not in cut and "torchtitan: not run" in line
    assert bench_gpu_moe.read_child(0, text, 120)["status"] == "ok"


@pytest.mark.fast
def test_gpu_moe_deltanet_judges_a_kernel_against_the_torch_path(monkeypatch):
    """The comparison that decides fla's `equal`, with stand-ins for fla's kernel on CPU: the token-by-token form of
    the same rule agrees with the chunked torch path (output and every input's gradient); one that drops the decay
    does not; the printed line gives the verdict and the speed ratio."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu_moe
    import gpu_deltanet

    from tessera.models.common.deltanet import recurrent_gated_delta_rule

    monkeypatch.setattr(gpu_deltanet, "fla_missing", lambda device: None)

    def measured(decay: float) -> dict:
        monkeypatch.setitem(gpu_deltanet.KERNELS, "fla", lambda q, k, v, g, beta, chunk_size:
                            recurrent_gated_delta_rule(q, k, v, g * decay, beta)[0])
        rows = {}
        gpu_deltanet.measure(100, 32, 0, 1, True, rows.__setitem__)  # 100 tokens: the last chunk padded
        return rows

    rows = measured(1.0)
    assert rows["torch"]["status"] == rows["fla"]["status"] == "ok"
    assert rows["fla_vs_torch"]["equal"] and rows["fla_vs_torch"]["max"] < 1e-4, rows["fla_vs_torch"]
    line = bench_gpu_moe.deltanet_line("seq100", {"status": "ok", **rows})
    assert "fla/torch" in line and ", equal (" in line
    wrong = measured(0.0)["fla_vs_torch"]
    assert not wrong["equal"] and wrong["dg"] == 1.0 and wrong["out"] > gpu_deltanet.BF16_TOL
