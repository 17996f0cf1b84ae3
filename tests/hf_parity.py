"""The HF round trip every family's test makes: logits after import and after export equal transformers', and
greedy generation equals theirs."""

import torch

from tessera.checkpoint.hf import save_hf
from tessera.generate import from_pretrained, generate


def assert_round_trip(theirs, ours, args, hf_class, folder, tmp_path, vocab_size: int = 97) -> None:
    """`theirs`: the transformers model saved in `folder`; `ours`: imported from it (eval, fp32)."""
    tokens = torch.randint(0, vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)
        save_hf(ours, args, tmp_path / "out")
        back = hf_class.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(back(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    model, _ = from_pretrained(folder)
    prompt = [3, 17, 42, 5]
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert generate(model, prompt, 12) == want[0, len(prompt):].tolist()
