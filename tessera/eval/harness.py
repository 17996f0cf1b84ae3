"""lm-eval's command line with Tessera's model registered as `tessera`:

    python -m tessera.eval.harness --model tessera --model_args checkpoint=DIR,hf=true,batch_size=8 --tasks ...

(lm-eval finds models it ships and those imported before it runs; this imports Tessera's, then runs lm-eval's own
`lm_eval` entry point with the same flags.)"""

import tessera.eval.lm  # noqa: F401  (registers `tessera`)

if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
