"""Mid-training and SFT: chat and prompt-completion data, templates equal to transformers', loss masks, the loss
normalized over the trained tokens of the whole global batch (equal to transformers' and across layouts), bad
records, and the document-boundary target under block-causal masking."""

import json
import random

import numpy as np
import pytest
import torch

from tessera.config import JobConfig
from tessera.data import build_dataloader, build_tokenizer
from tessera.data.chat import Context, PlainTemplate, TemplateError, build_template
from tessera.data.examples import encode_examples, example_format, examples
from tessera.data.masks import IGNORE, trained_tokens
from tessera.data.records import BadRecords
from tessera.data.tokenizer import ByteTokenizer
from tessera.trainer import loss_fn, token_inputs
from tests.launch import assert_matches, one_process, run_cases, run_local
from tests.sft_data import CONVERSATIONS, RICH, TAGGED, THINKING, TOOL_CALLING, TOOLS, chat_tokenizer, write_jsonl

B, E = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def apply_chat_template(folder, messages, **kwargs) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def plain(ids: np.ndarray) -> list[int]:
    return [int(i) if i >= 0 else int(~i) for i in ids]


@pytest.mark.fast
def test_the_tokenizers_template_gives_transformers_tokens_and_masks_the_assistant_turns(tmp_path):
    """A folder transformers saved (its template in chat_template.jinja): each conversation's tokens after BOS
    equal apply_chat_template's; the trained tokens are the assistant turns and their end of turn only."""
    folder = chat_tokenizer(tmp_path / "tok")
    tok, template = build_tokenizer(str(folder)), build_template(str(folder), "auto")
    for messages in CONVERSATIONS:
        (ids,) = encode_examples(tok, template.conversation(messages, assistant_only=True))
        assert plain(ids)[0] == tok.bos_id and ids[0] < 0
        assert plain(ids)[1:] == apply_chat_template(folder, messages)
        want = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
        got = tok._tok.decode([int(i) for i in ids if i >= 0], skip_special_tokens=False)
        assert got == want
        (every,) = encode_examples(tok, template.conversation(messages, assistant_only=False))
        assert plain(every) == plain(ids) and (every[1:] >= 0).all()


@pytest.mark.fast
def test_a_template_that_drops_earlier_turns_gives_one_example_per_assistant_turn(tmp_path):
    """As Qwen 3's: the conversation up to each assistant turn, as transformers renders it, that turn trained."""
    folder = chat_tokenizer(tmp_path / "tok", THINKING)
    tok, template = build_tokenizer(str(folder)), build_template(str(folder), "auto")
    messages = CONVERSATIONS[1]
    rendered = template.conversation(messages, assistant_only=True)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(rendered) == len(turns) == 2
    for ids, i in zip(encode_examples(tok, rendered), turns, strict=True):
        assert plain(ids)[1:] == apply_chat_template(folder, messages[:i + 1])
        got = tok._tok.decode([int(t) for t in ids if t >= 0], skip_special_tokens=False)
        assert got == "<think>\n\n</think>\n\n" + messages[i]["content"] + "<|im_end|>\n"


@pytest.mark.fast
def test_generation_tags_tools_text_parts_and_reasoning_render_as_transformers_does(tmp_path):
    """Published templates' other inputs, rendered as apply_chat_template renders them: a template's
    `{% generation %}` spans are the trained tokens, equal to its assistant mask; a record's tools and documents,
    content as text parts, an assistant's tool calls (empty content) and tool results, and reasoning under
    `reasoning` (which transformers passes as reasoning_content) reach the template; the tool-call turns are
    trained and the tool results not."""
    from transformers import AutoTokenizer

    documents = [{"title": "Maths", "text": "Sums are easy."}]
    for name, source in (("tagged", TAGGED), ("untagged", RICH)):
        folder = chat_tokenizer(tmp_path / name, source)
        tok, template, theirs = build_tokenizer(str(folder)), build_template(str(folder), "auto"), \
            AutoTokenizer.from_pretrained(str(folder))
        for messages, context in ((CONVERSATIONS[1], {}), (TOOL_CALLING, {"tools": TOOLS, "documents": documents})):
            (ids,) = encode_examples(tok, template.conversation(messages, True, Context(**context)))
            want = theirs.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=name == "tagged", **context)
            assert plain(ids)[1:] == list(want["input_ids"]), name
            trained = [int(i >= 0) for i in ids[1:]]
            if name == "tagged":
                assert trained == list(want["assistant_masks"])
            text = theirs.decode([int(i) for i in ids if i >= 0], skip_special_tokens=False)
            if messages is TOOL_CALLING:
                assert '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>' in text, text
                assert "<think>The tool said 4.</think>4, of course." in text and "tool\n4" not in text, text


@pytest.mark.fast
def test_sharegpt_records_and_bad_content_parts(tmp_path):
    """ShareGPT records (`conversations` of {from, value}, roles human / gpt / system / tool) read as they are,
    equal to the same conversation in messages; a content part that is not text is a bad record saying so."""
    folder = chat_tokenizer(tmp_path / "tok", RICH)
    fmt = example_format(JobConfig().training, str(folder))
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    for messages in CONVERSATIONS:
        sharegpt = {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in messages]}
        assert fmt.render(sharegpt) == fmt.render({"messages": messages})
    image = [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, *CONVERSATIONS[0][1:]]
    with pytest.raises(TemplateError, match="^message 1 has a 'image' content part; only text parts are trained on"):
        fmt.render({"messages": image})
    with pytest.raises(TemplateError, match="^message 1 is from 'bot', not one of ShareGPT's roles"):
        fmt.render({"conversations": [{"from": "bot", "value": "hi"}]})


@pytest.mark.fast
def test_the_plain_template_with_the_byte_tokenizer():
    """ROLE: CONTENT lines; the assistant's header untrained, its content and EOS trained."""
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Ciao"}]
    (ids,) = encode_examples(tok, PlainTemplate().conversation(messages, assistant_only=True))
    text = "system: Be brief.\nuser: Hi\nassistant: Hello!"
    want = [B, *text.encode(), E, *b"user: Bye\nassistant: Ciao", E]
    assert plain(ids) == want
    trained = [int(i) for i in ids if i >= 0]
    assert trained == [*b"Hello!", E, *b"Ciao", E]
    assert build_template("", "auto").__class__ is PlainTemplate


@pytest.mark.fast
def test_prompt_completion_trains_the_completion_and_eos(tmp_path):
    t = JobConfig().training
    t.dataset_format = "prompt_completion"
    fmt = example_format(t, "")
    (ids,) = encode_examples(ByteTokenizer(), fmt.render({"prompt": "2+2=", "completion": "4"}))
    assert plain(ids) == [B, *b"2+2=", *b"4", E] and [int(i) for i in ids if i >= 0] == [ord("4"), E]
    t.assistant_only_loss = False
    (ids,) = encode_examples(ByteTokenizer(), example_format(t, "").render({"prompt": "2+2=", "completion": "4"}))
    assert [int(i) for i in ids if i >= 0] == [*b"2+2=4", E]


@pytest.mark.fast
def test_bad_chat_records_are_counted_with_file_and_line(tmp_path):
    good = {"messages": CONVERSATIONS[0]}
    rows = [good, {"text": "no messages"}, {"messages": [{"role": "wizard", "content": "x"}]},
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]},
            {"messages": [{"role": "user", "content": "only a question"}]}, "{not json", [1, 2], good]
    file = write_jsonl(tmp_path / "chat.jsonl", rows)
    t = JobConfig().training
    t.dataset_format = "chat"
    bad = BadRecords(-1, quiet=True)
    got = list(examples(example_format(t, ""), "files", str(file), "train", 0, 0, bad))
    assert len(got) == 2 and bad.count == 6
    assert bad.examples == [f"{file}:2: no field 'messages' (training.dataset_messages_field)",
                            f"{file}:3: message 1 has role 'wizard', not one the templates know (system, user, "
                            f"assistant, tool)",
                            f"{file}:4: message 2 is an empty assistant turn"]
    with pytest.raises(ValueError, match=r"max_bad_records: 2 bad data records, more than 1; the latest, .*chat"
                                         r"\.jsonl line 3"):
        list(examples(example_format(t, ""), "files", str(file), "train", 0, 0, BadRecords(1, quiet=True)))
    # A role the tokenizer's template refuses (its raise_exception) is a bad record too.
    tool = write_jsonl(tmp_path / "tool.jsonl", [{"messages": [{"role": "tool", "content": "42"},
                                                               {"role": "assistant", "content": "ok"}]}])
    bad = BadRecords(-1, quiet=True)
    assert list(examples(example_format(t, str(chat_tokenizer(tmp_path / "tok"))), "files", str(tool), "train", 0,
                         0, bad)) == []
    assert bad.examples == [f"{tool}:1: unknown role tool"]


@pytest.mark.fast
def test_mostly_bad_chat_data_is_refused_before_launch_and_a_few_bad_records_pass(tmp_path, capsys):
    """The launch check samples the records of the files the run reads, file after file, not only their first
    example: a second file whose records are mostly unreadable would stop the run at training.max_bad_records, so
    it is refused before any rank starts, in one line naming it. Within a limit the data meets, it runs."""
    from tessera import config_cli

    good, data = {"messages": CONVERSATIONS[0]}, tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [good] * 40)  # whole: the first example was all that was checked
    write_jsonl(data / "b.jsonl", [good if i % 5 == 0 else {"text": "no messages"} for i in range(200)])
    argv = ["--model.flavor", "tiny", "--job.dump_folder", str(tmp_path / "run"), "--training.dataset", "files",
            "--training.dataset_path", str(data), "--training.dataset_format", "chat", "--training.seq_len", "64",
            "--training.local_batch_size", "4", "--training.steps", "100", "--training.max_bad_records"]
    assert config_cli.main([*argv, "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tessera: training.max_bad_records: 160 of the first 200 records of {data / 'b.jsonl'} "
                          f"are bad; at that rate about 160 of the ~240 records this run reads would be, more than "
                          f"10; the first: {data / 'b.jsonl'}:2: no field 'messages'"), err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()
    assert config_cli.main([*argv, "200"]) == 0 and capsys.readouterr().err == ""


@pytest.mark.fast
def test_chat_data_packs_its_examples_apart_by_default_and_causal_is_said(tmp_path, capsys):
    """model.attn_mask_type = auto (the default): block_causal for chat and prompt-completion examples, so that packed
    conversations never attend to each other; causal for text. Causal asked for on chat data runs, with one line."""
    from tessera.metrics import setup_logging
    from tessera.preflight import validate
    from tessera.schema import parse_args

    setup_logging(0)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS] * 20)
    base = ["--model.flavor", "tiny", "--training.dataset", "files", "--training.dataset_path", str(chat),
            "--training.seq_len", "64"]
    assert validate(parse_args(["--model.flavor", "tiny"]), 1).cfg.model.attn_mask_type == "causal"  # text
    for fmt in ("chat", "prompt_completion"):
        if fmt == "prompt_completion":
            write_jsonl(chat, [{"prompt": "2 + 2 = ", "completion": "4"}] * 60)
        argv = [*base, "--training.dataset_format", fmt]
        assert validate(parse_args(argv), 1).cfg.model.attn_mask_type == "block_causal"
        assert validate(parse_args([*argv, "--model.attn_mask_type", "causal"]), 1).cfg.model.attn_mask_type \
            == "causal"
        said = [line for line in capsys.readouterr().out.splitlines() if "model.attn_mask_type" in line]
        assert len(said) == 1 and said[0].endswith(f"causal lets each packed {fmt} example attend to the ones "
                                                   f"before it in its window; block_causal (the default for them) "
                                                   f"keeps it to itself"), said


def chat_file(path, n: int = 300, seed: int = 0):
    """Conversations of random lengths: some windows hold many trained tokens, some none."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()

    def say(k):
        return " ".join(rng.choice(words) for _ in range(k))

    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": say(rng.randint(0, 12))}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": say(rng.randint(1, 8))},
                         {"role": "assistant", "content": say(rng.randint(1, 5))}]
        rows.append({"messages": messages})
    return write_jsonl(path, rows)


@pytest.mark.fast
def test_the_loader_packs_examples_and_splits_long_ones_across_windows(tmp_path):
    """Labels are IGNORE exactly where the target is untrained; a conversation longer than a window continues in
    the next one: every trained token of the data is a label once."""
    file = chat_file(tmp_path / "chat.jsonl", n=20)
    cfg = JobConfig()
    t = cfg.training
    t.dataset, t.dataset_path, t.dataset_format, t.seq_len, t.local_batch_size, t.data_streams = \
        "files", str(file), "chat", 16, 1, 1
    loader = build_dataloader(cfg, ByteTokenizer(), 0, 1)
    rows = [json.loads(line)["messages"] for k, line in enumerate(file.read_text().splitlines()) if k % 100 != 99]
    stream = np.concatenate(encode_examples(ByteTokenizer(), [r for m in rows
                                                              for r in PlainTemplate().conversation(m, True)]))
    windows = len(stream) // 17
    got_inputs, got_labels = zip(*(loader.next_batch() for _ in range(windows)), strict=True)
    inputs, labels = torch.cat(got_inputs), torch.cat(got_labels)
    want = stream[:windows * 17].reshape(windows, 17)
    assert inputs.tolist() == [plain(w[:-1]) for w in want]
    assert labels.tolist() == [[int(i) if i >= 0 else IGNORE for i in w[1:]] for w in want]
    assert int(trained_tokens(labels)) == int((want[:, 1:] >= 0).sum()) > 0
    assert any(len(plain(ids)) > 17 for ids in encode_examples(ByteTokenizer(), [
        r for m in rows for r in PlainTemplate().conversation(m, True)]))  # the data holds long ones


@pytest.mark.fast
def test_block_causal_masking_trains_no_target_across_a_document_boundary():
    """The last token of one document (its EOS) does not predict the next one's BOS; causal masking keeps it."""
    window = torch.tensor([[B, 1, 2, E, B, 3, 4, E, B]])
    tokens, labels = window[:, :-1], window[:, 1:]
    _, block = token_inputs(tokens, labels, B, None, torch.device("cpu"), eos=E)
    assert block.tolist() == [[1, 2, E, IGNORE, 3, 4, E, IGNORE]]
    # A tokenizer whose BOS is its EOS (<|endoftext|>): each document's own end is still trained, the junction not.
    same = torch.tensor([[E, 1, 2, E, E, 3, 4, E, E]])
    _, block = token_inputs(same[:, :-1], same[:, 1:], E, None, torch.device("cpu"), eos=E)
    assert block.tolist() == [[1, 2, E, IGNORE, 3, 4, E, IGNORE]]
    _, causal = token_inputs(tokens, labels, None, None, torch.device("cpu"))
    assert causal.tolist() == labels.tolist()


def test_the_loss_equals_transformers_with_ignored_labels(tmp_path):
    """Packed chat windows through a tiny Qwen 3 of a folder transformers saved: Tessera's loss of two micro-batches
    (the chunked head and the whole-logits loss, each summed over trained tokens and divided by those of both)
    equals transformers' with labels -100 where untrained and num_items_in_batch the trained tokens of both."""
    import transformers

    from tests.hf_parity import import_hf

    folder = chat_tokenizer(tmp_path / "hf")
    tok = build_tokenizer(str(folder))
    config = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, intermediate_size=128, vocab_size=tok.vocab_size,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    theirs = transformers.Qwen3ForCausalLM(config).eval()
    theirs.save_pretrained(folder)
    ours, _ = import_hf("qwen3", folder, seq=32)
    cfg = JobConfig()
    t = cfg.training
    t.dataset, t.dataset_format, t.seq_len, t.local_batch_size, t.data_streams = "files", "chat", 32, 2, 1
    t.dataset_path = str(write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 3]))
    cfg.model.hf_assets_path = str(folder)
    loader = build_dataloader(cfg, tok, 0, 1)
    batches = [loader.next_batch() for _ in range(2)]
    n = sum(int(trained_tokens(y)) for _, y in batches)
    assert 0 < n < 2 * 2 * 32
    ours.loss_chunks = 4
    with torch.no_grad():
        chunked = sum(ours(x, labels=y) for x, y in batches) / n
        whole = sum(loss_fn(ours(x), y) for x, y in batches) / n
        hf = sum(theirs(torch.cat([x, x[:, :1]], 1), labels=torch.cat([torch.full_like(y[:, :1], IGNORE), y], 1),
                        num_items_in_batch=n).loss for x, y in batches)
    torch.testing.assert_close(chunked, hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, hf, rtol=1e-5, atol=1e-5)
    # The trainer, started from the folder (checkpoint.initial_load_in_hf), logs that loss for its first step of
    # those two micro-batches, and their trained tokens.
    (first,) = run_local(tmp_path / "run", "--model.name", "qwen3", "--model.flavor=", "--model.hf_assets_path",
                         str(folder), "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
                         "--checkpoint.initial_load_path", str(folder), "--training.steps", "1",
                         "--training.dataset", "files", "--training.dataset_path", t.dataset_path,
                         "--training.dataset_format", "chat", "--training.local_batch_size", "2",
                         "--training.global_batch_size", "4", "--training.data_streams", "1")
    assert abs(first["loss"] - hf.item()) < 1e-5 and first["trained_tokens"] == n


STEPS = 3


@pytest.mark.ranks
def test_layouts_equal_one_process_with_uneven_masks(tmp_path):
    """Chat data whose windows hold different numbers of trained tokens (some none): FSDP 2, FSDP 2 with
    accumulation, PP 2, CP 2 and TP 2 (loss parallel on whole logits) each equal one process of the same global
    batch: per-step losses (the mean over the step's trained tokens), grad norms and step-1 gradients."""
    chat = ["--training.dataset", "files", "--training.dataset_path", str(chat_file(tmp_path / "chat.jsonl")),
            "--training.dataset_format", "chat", "--training.data_streams", "8"]
    reference = one_process([*chat, "--training.local_batch_size", "8"], STEPS)
    cases = {"fsdp2": ["--training.local_batch_size", "4"],
             "fsdp2 + accumulation": ["--training.local_batch_size", "2", "--training.global_batch_size", "8"],
             "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"],
             "cp2": ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8"],
             "tp2, loss parallel": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8",
                                    "--training.loss_chunks", "1"]}
    results = run_cases(2, [[*chat, *case] for case in cases.values()], STEPS)
    for name, got in zip(cases, results, strict=True):
        try:
            assert_matches(got, reference, 1e-5, what=("grads",))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_validation_reports_the_masked_loss_of_a_held_out_chat_file(tmp_path):
    """validation.dataset_path is read whole; the validation loss is the mean over the trained tokens of all its
    batches (not over every token)."""
    from tessera.train import validate_loss
    from tests.dist_worker import _trainer

    held = chat_file(tmp_path / "held.jsonl", n=10, seed=1)
    tr = _trainer(["--training.dataset", "files", "--training.dataset_path", str(chat_file(tmp_path / "chat.jsonl")),
                   "--training.dataset_format", "chat", "--training.local_batch_size", "2", "--validation.enable",
                   "--validation.steps", "2", "--validation.dataset_path", str(held)], 1, str(tmp_path / "run"))
    got = validate_loss(tr)
    loader = build_dataloader(tr.cfg, tr.tokenizer, 0, 1, "validation")
    first = json.loads(held.read_text().splitlines()[0])["messages"]
    (want,) = encode_examples(ByteTokenizer(), PlainTemplate().conversation(first, True))
    summed, every, n = 0.0, 0.0, 0
    with torch.no_grad():
        for step in range(2):
            x, y = loader.next_batch()
            if step == 0:
                assert x[0, :len(want)].tolist() == plain(want)[:32]
            logits = tr.step_parts.model(x)
            summed, n = summed + loss_fn(logits, y), n + int(trained_tokens(y))
            every += loss_fn(logits, x.roll(-1, 1))  # every token, for contrast
    assert abs(got - summed.item() / n) < 1e-5
    assert abs(got - every.item() / (2 * 2 * 32)) > 1e-2


def test_prepared_chat_data_stores_the_loss_mask(tmp_path):
    """python -m tessera.data.prepare --format chat: the ids and, beside them, which are trained; a run reads its
    windows masked as streamed ones are, and a text run refuses the folder."""
    from tessera.data import prepare, tokens
    from tessera.data.records import DataError
    from tessera.data.tokens import TokenShards, read_manifest

    file, out = chat_file(tmp_path / "chat.jsonl", n=60), tmp_path / "prepared"
    assert prepare.main(["--input", str(file), "--output", str(out), "--format", "chat", "--workers", "1",
                         "--tasks", "1", "--validation_every", "0"]) == 0
    manifest = read_manifest(str(out))
    assert manifest["examples"] == {"kind": "chat", "messages_field": "messages", "chat_template": "auto",
                                    "assistant_only": True}
    rows = [json.loads(line)["messages"] for line in file.read_text().splitlines()]
    want = np.concatenate(encode_examples(ByteTokenizer(), [r for m in rows
                                                            for r in PlainTemplate().conversation(m, True)]))
    shards = TokenShards(str(out), manifest, "train")
    assert shards.read(0, shards.tokens).tolist() == want.tolist()
    cfg = JobConfig()
    t = cfg.training
    t.dataset, t.dataset_path, t.dataset_format, t.seq_len, t.local_batch_size = "tokenized", str(out), "chat", 64, 8
    _, labels = build_dataloader(cfg, ByteTokenizer(), 0, 1).next_batch()
    assert 0 < int(trained_tokens(labels)) < labels.numel()
    t.dataset_format = "text"
    with pytest.raises(DataError, match="prepared from chat data; set --training.dataset_format chat"):
        tokens.check(cfg)


@pytest.mark.fast
def test_a_resume_in_another_dataset_format_is_refused():
    """A checkpoint's data position counts samples of its format's examples."""
    import dataclasses

    from tessera.config import ConfigError
    from tessera.preflight.resume import check_resumed_data
    from tessera.schema import parse_args

    cfg = parse_args(["--training.dataset", "files", "--training.dataset_path", "chat.jsonl",
                      "--training.dataset_format", "chat"])
    saved = {**dataclasses.asdict(cfg.training), "dataset_format": "text"}
    with pytest.raises(ConfigError, match="^training.dataset_format: 'chat', but the checkpoint at ckpt counted its "
                                          "data position in examples of 'text' data; set --training.dataset_format "
                                          "text to resume it"):
        check_resumed_data(cfg, "ckpt", saved)
