"""Downstream tasks on a checkpoint, with lm-eval-harness:

    python -m tessera.eval --checkpoint.initial_load_path outputs/llama3_debug/checkpoint/step-100 \\
        --eval.tasks configs/eval/tiny_mc.yaml,configs/eval/tiny_gen.yaml [--eval.limit 100] [--json]
    python -m tessera.eval --checkpoint.initial_load_in_hf --checkpoint.initial_load_path HF_DIR --eval.tasks arc_easy

The model is `checkpoint.initial_load_path` (a Tessera checkpoint folder in any layout, or with
`initial_load_in_hf` a Hugging Face folder), else the newest checkpoint under `job.dump_folder`; the tokenizer is
`model.hf_assets_path`, else the Hugging Face folder's own, else bytes. It prints lm-eval's table of the results
(with --json, the scores as JSON). The same model is lm-eval's `tessera`: `python -m tessera.eval.harness --model
tessera --model_args checkpoint=DIR,hf=true --tasks ...` is lm-eval's command line with it registered.
"""

import contextlib
import json
import sys

from tessera.config import ConfigError
from tessera.pretrained import from_pretrained, pick_device
from tessera.schema import help_text, parse_args


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        options = help_text().partition("\n\n")[2]
        print(f"{__doc__.strip()}\n\nOptions: [eval], and [model] and [checkpoint] for what to load.\n\n{options}")
        return 0
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    try:
        cfg = parse_args(argv)
        if not cfg.eval.tasks:
            raise ConfigError("eval.tasks: empty; name lm-eval tasks or task YAML files")
        c = cfg.checkpoint
        source = c.initial_load_path or cfg.job.dump_folder
        from tessera.eval.lm import TesseraLM, lm_tokenizer
        from tessera.eval.tasks import evaluate, resolve, scores, table

        resolve(cfg.eval.tasks, cfg.eval.num_fewshot)  # before the model loads
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the results
            model, tokenizer = from_pretrained(source, pick_device("auto"), hf=c.initial_load_in_hf or None,
                                               max_seq_len=None, hf_assets_path=cfg.model.hf_assets_path)
            lm = TesseraLM(model, lm_tokenizer(tokenizer), batch_size=cfg.eval.batch_size,
                           max_length=model.args.max_seq_len, max_gen_toks=cfg.eval.max_gen_toks)
            results = evaluate(lm, cfg)
    except ConfigError as e:
        print(f"tessera.eval: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(scores(results), indent=1))
    else:
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
