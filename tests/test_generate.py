"""`tessera.generate` and `tessera.from_pretrained`: greedy decoding equals transformers' generate() (with its KV
cache) for tiny random Llama and Qwen 3 models that are no preset; the KV cache equals a full recompute; the CLI
reads a Tessera checkpoint."""

import json

import pytest
import torch

from tessera.generate import from_pretrained, generate, main
from tests.launch import run_local

PROMPT = [3, 17, 42, 5, 9]


def _hf_model(kind: str, path):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                  intermediate_size=80, vocab_size=101, max_position_embeddings=64, bos_token_id=None,
                  eos_token_id=None, pad_token_id=0)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen3Config(**common, head_dim=16)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # larger weights: logits far apart, so greedy choices are not ties decided by noise
        for p in model.parameters():
            p.mul_(4 if p.dim() > 1 else 1)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_equals_transformers_generate(kind, tmp_path):
    theirs = _hf_model(kind, tmp_path)
    ours, _ = from_pretrained(tmp_path)
    assert not ours.training
    expected = theirs.generate(torch.tensor([PROMPT]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert generate(ours, PROMPT, 20) == expected[0, len(PROMPT):].tolist()


def test_kv_cache_equals_recomputing_the_whole_sequence(tmp_path):
    _hf_model("qwen3", tmp_path)
    model, _ = from_pretrained(tmp_path)
    for kw in (dict(), dict(temperature=0.9, top_k=20, top_p=0.9, seed=3), dict(temperature=1.5, seed=1)):
        cached = generate(model, PROMPT, 16, **kw)
        assert cached == generate(model, PROMPT, 16, use_cache=False, **kw), kw
    ids = torch.tensor([PROMPT + cached])
    cache = model.new_cache(1, ids.shape[1], torch.float32)
    steps = [model(ids[:, :len(PROMPT)], cache)[0, -1]] + [model(ids[:, i:i + 1], cache)[0, -1]
                                                           for i in range(len(PROMPT), ids.shape[1])]
    with torch.no_grad():
        torch.testing.assert_close(torch.stack(steps[:-1]).detach(), model(ids)[0, len(PROMPT) - 1:-1],
                                   rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded_and_top_k_1_is_greedy(tmp_path):
    _hf_model("llama", tmp_path)
    model, _ = from_pretrained(tmp_path)
    a, b = (generate(model, PROMPT, 12, temperature=1.0, seed=7) for _ in range(2))
    assert a == b and a != generate(model, PROMPT, 12, temperature=1.0, seed=8)
    assert generate(model, PROMPT, 12, temperature=1.0, top_k=1, seed=5) == generate(model, PROMPT, 12)
    assert generate(model, PROMPT, 12, temperature=1.0, top_p=1e-6, seed=5) == generate(model, PROMPT, 12)


def test_cli_reads_a_tessera_checkpoint(tmp_path, capsys):
    run_local(tmp_path / "run", "--training.steps", "2", "--checkpoint.enable", "--lr_scheduler.warmup_steps", "0")
    capsys.readouterr()
    argv = ["--job.dump_folder", str(tmp_path / "run"), "--generate.prompt_ids", "256,100,101",
            "--generate.max_new_tokens", "6", "--generate.temperature", "0", "--generate.json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    model, tokenizer = from_pretrained(tmp_path / "run")
    assert out["prompt_ids"] == [256, 100, 101] and out["output_ids"] == generate(model, [256, 100, 101], 6,
                                                                                    eos_id=tokenizer.eos_id)
    assert out["text"] == tokenizer.decode(out["output_ids"])
    assert main(["--job.dump_folder", str(tmp_path / "run"), "--generate.prompt", "def f(", "--generate.max_new_tokens",
                 "4", "--generate.seed", "1"]) == 0
    assert main(["--job.dump_folder", str(tmp_path / "nothing_here")]) == 2
    assert "no complete checkpoint in" in capsys.readouterr().err


def test_hf_folder_stops_at_its_own_eos_and_cli_help(tmp_path, capsys):
    """A Hugging Face folder without tokenizer files stops after its eos_token_id (generation_config.json, else
    config.json), not the byte tokenizer's 257; generate.ignore_eos samples on. --help prints the options."""
    _hf_model("llama", tmp_path)
    argv = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(tmp_path),
            "--generate.prompt_ids", ",".join(map(str, PROMPT)), "--generate.max_new_tokens", "8",
            "--generate.temperature", "0", "--generate.json"]

    def sample(*extra: str) -> list[int]:
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)["output_ids"]

    full = sample()
    assert len(full) == 8
    eos = full[2]
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    assert sample() == full[:full.index(eos) + 1]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [full[1], 999]}))
    assert sample() == full[:full.index(full[1]) + 1]
    assert sample("--generate.ignore_eos") == full
    assert main(["--help"]) == 0
    assert "--generate.ignore_eos" in capsys.readouterr().out
