"""Tessera's model as an lm-eval-harness language model (`TesseraLM`, registered as `tessera`).

lm-eval turns a task into requests of three kinds, and this answers them over any Tessera decoder:
- loglikelihood (context, continuation) -> (summed log-probability of the continuation, whether greedy decoding
  would produce it): the two encoded together, cut from the left to the model's length, scored in batches;
- loglikelihood_rolling (text) -> its summed log-probability, over windows of the model's length (lm-eval's
  rolling windows, one token of context between them);
- generate_until (context, gen_kwargs) -> greedy text with the model's KV cache, stopped at a stop sequence, the
  EOS token or max_gen_toks.
Tokens are encoded as lm-eval's `hf` backend encodes them (transformers' tokenizer of the folder, its special
tokens as the tokenizer adds them), so the two score the same folder alike.

Over several ranks (in-loop evaluation), each data-parallel rank answers its share of the requests (lm-eval deals
them and pads them even); every rank runs the same number of forwards, as FSDP's collectives need, and rank 0
gathers the results over the data-parallel group.
"""

import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch.distributed.tensor import DTensor

from tessera.parallel import cp

log = logging.getLogger("tessera")


class ByteTokens:
    """Tessera's byte tokenizer in the shape lm-eval's requests use (encode/decode, the special ids)."""

    def __init__(self, tokenizer):
        self.inner, self.bos_token_id, self.eos_token_id = tokenizer, tokenizer.bos_id, tokenizer.eos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.inner.decode([ids] if isinstance(ids, int) else list(ids))


def lm_tokenizer(tokenizer):
    """For Tessera's tokenizer: transformers' tokenizer of its folder (what lm-eval's `hf` backend encodes with),
    or the byte tokenizer as it is."""
    if getattr(tokenizer, "folder", None) is None:
        return ByteTokens(tokenizer)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer.folder))


@register_model("tessera")
class TesseraLM(TemplateLM):
    def __init__(self, model: torch.nn.Module | None = None, tokenizer=None, batch_size: int = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, group=None, width_multiple: int = 1,
                 cp_group=None, forward: Callable | None = None, stage_group=None, checkpoint: str = "",
                 hf: bool | None = None, hf_assets_path: str = "", device: str = "auto", **_):
        """In-loop: the live `model` and `tokenizer` (lm_tokenizer's); `group`: the data-parallel process group the
        requests are dealt over; `width_multiple`: the tensor-parallel degree, whose sequence parallelism splits
        every forward's sequence evenly (widths are padded to it, and generation recomputes the sequence instead of
        caching: a step's one token cannot be split); `cp_group`: context parallelism's, whose ranks each run two
        chunks of every sequence (widths padded to 2 x its size, no cache); `forward`: ids [B, T] -> logits, or None on
        a rank that holds none (a pipeline stage before the last), instead of calling the model (no cache);
        `stage_group`: the ranks of one such forward, which share its results (pipelining's group); `max_length`:
        the model's by default.
        From lm-eval's command
        line (`--model tessera --model_args checkpoint=DIR,...`): the checkpoint a Tessera run saved (DCP, any
        layout) or a Hugging Face folder, loaded in this process."""
        super().__init__()
        if model is None:
            from tessera.pretrained import from_pretrained, pick_device

            if str(device).startswith("cuda") and not torch.cuda.is_available():  # lm-eval's default device
                log.warning(f"tessera: device {device} asked for, and this machine has no GPU: cpu")
                device = "cpu"
            model, own = from_pretrained(checkpoint, pick_device(device), hf=_flag(hf),
                                         max_seq_len=int(max_length or 0) or None, hf_assets_path=hf_assets_path)
            tokenizer = lm_tokenizer(own)
        self.model, self.tokenizer, self.group = model, tokenizer, group
        self.forward, self.stage_group = forward, stage_group
        self.batch_size_per_rank, self.max_gen_toks, self.cp_group = int(batch_size), int(max_gen_toks), cp_group
        cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.width_multiple = math.lcm(width_multiple, 2 * cp) if cp > 1 else width_multiple
        self.max_length = int(max_length or model.args.max_seq_len)  # what lm-eval cuts contexts to
        self._device = next(model.parameters()).device
        self._rank = dist.get_rank(group) if group is not None else 0
        self._world_size = dist.get_world_size(group) if group is not None else 1

    # lm-eval's hooks for several ranks: the data-parallel group
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        out = [None] * self._world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out if self._rank == dst else None

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier(group=self.group)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:  # as lm-eval's hf backend: BOS, else EOS
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:  # the tokenizer's own specials, unless the text starts with the prefix
            add_special_tokens = not string.startswith(self.tokenizer.decode([self.prefix_token_id],
                                                                             skip_special_tokens=False))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _forwards(self, mine: int) -> int:
        """How many batches every rank runs: the most any rank has (FSDP's collectives pair up forwards)."""
        if self._world_size == 1:
            return mine
        n = torch.tensor(mine, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        return int(n)

    def _shared(self, value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """`value` computed where the logits are, on every rank of the stage group (`like`: its zeros elsewhere)."""
        if self.stage_group is None:
            return value
        value = value if value is not None else like
        dist.all_reduce(value, group=self.stage_group)  # one rank's value, zeros from the others
        return value

    def _logits(self, rows: list[list[int]], cache=None) -> torch.Tensor | None:
        """The logits of `rows` padded on the right [B, T, V] (a causal model's positions never see the padding
        after them); None on a rank that holds none (see `forward`)."""
        width = -(-max(len(r) for r in rows) // self.width_multiple) * self.width_multiple
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.device)
        if self.forward is not None:
            return self.forward(ids)
        if self.cp_group is not None:  # this rank's chunks of the sequence, at their positions; then all of them
            rank, size = dist.get_rank(self.cp_group), dist.get_world_size(self.cp_group)
            positions = torch.arange(width, device=self.device).expand(ids.shape)
            local = self.model(cp.shard_sequence(ids, rank, size), positions=cp.shard_sequence(positions, rank, size))
            return cp.gather_sequence(_full(local), self.cp_group)
        return _full(self.model(ids, cache) if cache is not None else self.model(ids))

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out, size = [], self.batch_size_per_rank
        batches = [requests[i:i + size] for i in range(0, len(requests), size)]
        for k in range(self._forwards(len(batches))):
            batch = batches[k] if k < len(batches) else batches[-1][:1] if batches else [(None, [0], [0])]
            rows, spans = [], []
            for _, context, continuation in batch:
                whole = (context + continuation)[-(self.max_length + 1):]
                rows.append(whole[:-1])
                spans.append((len(whole) - 1 - len(continuation), continuation))
            results = self._shared(self._scores(rows, spans), torch.zeros(len(rows), 2, device=self.device))
            if k < len(batches):  # else a forward that only keeps the other ranks company
                out += [(logprob, bool(greedy)) for logprob, greedy in results.tolist()]
        return out

    def _scores(self, rows: list[list[int]], spans: list[tuple[int, list[int]]]) -> torch.Tensor | None:
        """[B, 2]: each row's log-likelihood of its continuation (its tokens from `start`), and whether that is the
        greedy one (1.0)."""
        logits = self._logits(rows)
        if logits is None:
            return None
        logprobs, out = F.log_softmax(logits.float(), dim=-1), []
        for row, (start, continuation) in zip(logprobs, spans, strict=True):
            scores = row[start:start + len(continuation)]
            target = torch.tensor(continuation, device=scores.device)
            greedy = (scores.argmax(-1) == target).all().float()
            out.append(torch.stack([scores.gather(-1, target[:, None]).sum(), greedy]))
        return torch.stack(out)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        out, pending = [], [req.args for req in requests]
        for k in range(self._forwards(len(pending))):
            context, gen_kwargs = pending[min(k, len(pending) - 1)] if pending else ("", {})
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            text = self._greedy(self.tok_encode(context)[-(self.max_length - kwargs["max_gen_toks"]):] or
                                [self.prefix_token_id], until, kwargs["max_gen_toks"], done=k >= len(pending))
            if k < len(pending):
                out.append(postprocess_generated_text(text, until, None))
        return out

    def _greedy(self, prompt: list[int], until: list[str], max_new: int, done: bool) -> str:
        """Greedy tokens after `prompt` with the KV cache until a stop sequence, EOS or `max_new`; over several
        ranks every rank steps until all are done (`done`: this rank only keeps the others company)."""
        weight, cached = next(self.model.parameters()), self.width_multiple == 1 and self.forward is None
        cache = self.model.new_cache(1, len(prompt) + max_new, weight.dtype, self.device) if cached else None
        token, new = self._argmax(prompt, len(prompt) - 1, cache), []
        for _ in range(max_new):
            if not done:
                new.append(token)
                text = self.tokenizer.decode(new)
                done = token == self.eot_token_id or any(stop in text for stop in until) or len(new) == max_new
            if self._all(done):
                break
            tokens = prompt + new if not done else prompt + new + [token]  # a rank done only keeps company
            token = self._argmax([token], 0, cache) if cached else self._argmax(tokens, len(tokens) - 1)
        return self.tokenizer.decode(new)

    def _argmax(self, row: list[int], at: int, cache=None) -> int:
        """The greedy token after position `at` of `row`."""
        logits = self._logits([row], cache)
        token = logits[0, at].argmax() if logits is not None else None
        return int(self._shared(token, torch.zeros((), dtype=torch.long, device=self.device)))

    def _all(self, done: bool) -> bool:
        if self._world_size == 1:
            return done
        flag = torch.tensor(int(done), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag)


def _full(logits: torch.Tensor) -> torch.Tensor:
    return logits.full_tensor() if isinstance(logits, DTensor) else logits  # vocab-sharded under loss parallel


def _flag(value) -> bool | None:
    """lm-eval's --model_args come as strings: hf=true."""
    return value if value is None or isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
