"""Config sections: one dataclass per TOML section; each field's doc lives in its `opt`."""

from collections.abc import Mapping
from dataclasses import dataclass, field, make_dataclass
from typing import Any

# Converter names (model.converters) and their recipes; tessera/parallel/quantize.py maps them onto torchao.
FLOAT8_CONVERTER, MX_CONVERTER = "quantize.linear.float8", "quantize.linear.mx"
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MX_RECIPES = ("mxfp8_cublas", "mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp")
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                "DualPipeV")
LOADABLE_PARTS = ("optimizer", "train_state", "lr_scheduler", "dataloader", "rng")
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")  # checkpoint.save_on_signal: what a scheduler sends before a kill


def opt(default: Any, doc: str, *, choices: tuple = (), min: float | None = None, max: float | None = None,
        below: float | None = None, table: bool = False) -> Any:
    """A config field: its default, the one-line doc `--help` prints, and its valid range ([min, max], and
    strictly under `below`). Floats must be finite. `table`: a string option that TOML may also give as a table
    {NAME = number}, read as "NAME:number,..."."""
    meta = {"doc": doc, "choices": choices, "min": min, "max": max, "below": below, "table": table}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str = opt("", "TOML file to read; CLI flags override it")
    dump_folder: str = opt("./outputs", "folder for logs, metrics, TensorBoard events and checkpoints")
    description: str = opt("", "free text recorded with the run")


@dataclass
class Model:
    name: str = opt("llama3", "model family: a folder of tessera/models")
    flavor: str = opt("", "size preset: a row of the table in tessera/models/<name>/args.py; empty = the "
                      "architecture of the checkpoint resumed or the Hugging Face config.json imported, else "
                      "debugmodel")
    hf_assets_path: str = opt("", "folder holding tokenizer.json (+ tokenizer_config.json); empty = built-in byte "
                              "tokenizer")
    converters: list[str] = opt([], "module converters applied before parallelism, e.g. quantize.linear.float8")
    attn_mask_type: str = opt("auto", "causal: a token attends every earlier one of its window; block_causal: "
                              "only those of its own document (documents packed into a window start at BOS); "
                              "auto: block_causal for chat and prompt_completion data (packed examples never see "
                              "each other), causal otherwise", choices=("auto", "causal", "block_causal"))


@dataclass
class Optimizer:
    name: str = opt("AdamW", "optimizer; Muon: Muon for the blocks' weight matrices (and experts'), AdamW (lr, "
                    "betas, eps, weight_decay) for the rest; SGD: plain SGD (lr, weight_decay as L2), a reference",
                    choices=("AdamW", "Adam", "Muon", "SGD"))
    lr: float = opt(8e-4, "peak learning rate", min=0.0)
    beta1: float = opt(0.9, "Adam beta1", min=0.0, below=1.0)
    beta2: float = opt(0.95, "Adam beta2", min=0.0, below=1.0)
    eps: float = opt(1e-8, "Adam epsilon", min=0.0)
    weight_decay: float = opt(0.1, "decoupled weight decay (AdamW) or L2 penalty (Adam)", min=0.0)
    implementation: str = opt("auto", "auto = fused (the fastest on CUDA and CPU)",
                              choices=("auto", "fused", "foreach", "for-loop"))
    weight_decay_exclude: bool = opt(False, "no weight decay on norms, biases (1-D parameters) and the input "
                                     "embedding (a tied output head with it); off by default, as turning it on "
                                     "changes what a config with weight_decay > 0 trains")
    embedding_lr_multiplier: float = opt(1.0, "the input embedding's lr is optimizer.lr times this (a tied output "
                                         "head with it)", min=0.0)
    output_lr_multiplier: float = opt(1.0, "the output head's lr is optimizer.lr times this", min=0.0)
    muon_momentum: float = opt(0.95, "Muon: momentum of the gradient average", min=0.0, below=1.0)
    muon_nesterov: bool = opt(True, "Muon: Nesterov momentum")
    muon_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations orthogonalizing each update", min=1, max=99)
    muon_ns_coefficients: str = opt("3.4445,-4.7750,2.0315", "Muon: the quintic iteration's coefficients a,b,c")
    muon_ns_dtype: str = opt("bfloat16", "Muon: dtype of the Newton-Schulz iteration (float32: bit-for-bit "
                             "parity checks)", choices=("bfloat16", "float32"))
    muon_update_scale: str = opt("match_rms_adamw", "Muon: lr factor per matrix [rows, cols]: match_rms_adamw = "
                                 "0.2 sqrt(max(rows, cols)), the update RMS of AdamW (its lr carries over); original "
                                 "= sqrt(max(1, rows/cols)); none = 1", choices=("match_rms_adamw", "original", "none"))
    qk_clip_threshold: float = opt(0.0, "MuonClip's QK-clip (Kimi K2): after each Muon step, a head whose largest "
                                   "attention logit of the step exceeded this has its query/key projections scaled "
                                   "to bring it down to it (MLA: the parts without RoPE by sqrt(t/S), the query's "
                                   "RoPE part by t/S); 0: off (Kimi K2 trained with 100)", min=0.0)
    state_dtype: str = opt("float32", "AdamW/Adam (not Muon): dtype of the two moments between steps: bfloat16 "
                           "halves the optimizer state (parameters, gradients and the update stay float32; each "
                           "parameter's update widens its moments for the step, one parameter at a time)",
                           choices=("float32", "bfloat16"))


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "steps of linear warmup from ~0 to optimizer.lr", min=0)
    decay_ratio: float | None = opt(None, "share of steps spent decaying at the end (WSD); none = decay right "
                                    "after warmup", min=0.0, max=1.0)
    decay_type: str = opt("linear", "shape of the decay", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "final lr as a fraction of optimizer.lr", min=0.0, max=1.0)


@dataclass
class Training:
    local_batch_size: int = opt(8, "sequences per rank per micro-batch", min=1)
    global_batch_size: int = opt(-1, "sequences per optimizer step over all ranks; -1 = local x DP (no accumulation)")
    seq_len: int = opt(2048, "tokens per sequence", min=2)
    max_norm: float = opt(1.0, "clip gradients to this global L2 norm; 0 = no clipping", min=0.0)
    steps: int = opt(10000, "optimizer steps to train", min=1)
    dataset: str = opt("stdlib", "stdlib (built-in offline corpus), files (training.dataset_path), tokenized (a folder "
                       "made by python -m tessera.data.prepare, memory-mapped), c4, or a hub id ORG/NAME")
    dataset_path: str = opt("", "local file, folder (searched recursively) or glob of: .txt (a file is one document), "
                            ".jsonl (one JSON object per line), .json (one JSON array of objects, or JSON Lines), "
                            ".parquet (a string column); each object's text is in dataset_text_field; a local copy "
                            "of a hub dataset; or a prepared folder (with files, it is detected and read as "
                            "tokenized); with dataset_mix, the folder its names are in")
    dataset_mix: str = opt("", "tokenized: prepared datasets and their weights, NAME:WEIGHT,... or a TOML table "
                           "{NAME = WEIGHT}; a NAME is a folder under dataset_path (or a path); each dataset gives "
                           "its share of every block of 4096 samples", table=True)
    dataset_text_field: str = opt("text", "field holding the document text in json/jsonl/parquet/hub rows")
    dataset_format: str = opt("text", "text (documents, every token trained), chat (conversations: a list of "
                              "{role, content} messages in dataset_messages_field, rendered by chat_template) or "
                              "prompt_completion (string fields prompt and completion); chat and prompt_completion "
                              "read json/jsonl/parquet files, hub datasets or prepared folders (docs/sft.md)",
                              choices=("text", "chat", "prompt_completion"))
    dataset_messages_field: str = opt("messages", "chat: the field holding each conversation's messages")
    chat_template: str = opt("auto", "chat: auto (the tokenizer's own chat_template from tokenizer_config.json, "
                             "else plain) or plain (ROLE: CONTENT lines, each assistant turn ending in EOS; "
                             "docs/sft.md)", choices=("auto", "plain"))
    assistant_only_loss: bool = opt(True, "chat: train on the assistant turns only (false: every token); "
                                    "prompt_completion: on the completion only (false: the prompt too)")
    data_streams: int = opt(64, "packed streams the documents are dealt to; a rank tokenizes only its streams' "
                            "documents, 1/gcd(data_streams, DP degree) of them; part of the data order: keep it "
                            "fixed for a run", min=1)
    max_bad_records: int = opt(100, "data records that may be skipped (malformed JSON, a text that is not a string, "
                               "bytes that are not UTF-8), each counted and logged with its file and line; one more "
                               "stops the run; files: the launch samples each file's first 1000 records and refuses "
                               "data whose rate of bad ones would pass it over the records the run reads; -1 = no "
                               "limit", min=-1)
    seed: int = opt(0, "seed for initialization and data order", min=0, max=2**32 - 1)
    deterministic: bool = opt(False, "use deterministic kernels (bit-exact reruns, slower)")
    mixed_precision_param: str = opt("auto", "dtype of params in compute; auto = bfloat16 on accelerators, float32 "
                                     "on CPU",
                                     choices=("auto", "float32", "bfloat16"))
    mixed_precision_reduce: str = opt("float32", "dtype of gradient reduction", choices=("float32", "bfloat16"))
    enable_cpu_offload: bool = opt(False, "keep sharded params, grads and optimizer state in CPU memory (FSDP2)")
    loss_chunks: int = opt(8, "the output head and the token cross-entropy run over this many slices of each "
                           "sequence, one at a time, so the whole [tokens, vocab] logits never exist (backward "
                           "recomputes a slice's logits: one more head matmul); 1 = the whole logits at once; "
                           "families with a loss of their own (Flux) ignore it", min=1)
    nonfinite_policy: str = opt("stop", "a step whose loss or grad norm is not finite: stop (the run ends naming it; "
                                "no checkpoint is saved after it) or skip (no update: counted, logged, and the run "
                                "goes on; costs a host sync per step)", choices=("stop", "skip"))
    max_skipped_steps: int = opt(10, "with nonfinite_policy = skip: one more skipped step than this stops the run",
                                 min=0)


@dataclass
class Validation:
    enable: bool = opt(False, "evaluate loss on the held-out split")
    freq: int = opt(100, "evaluate every N steps", min=1)
    steps: int = opt(4, "batches per evaluation", min=1)
    dataset_path: str = opt("", "training.dataset = files: a held-out file, folder or glob, read whole (in "
                            "training.dataset_format), instead of record 100, 200, ... of training.dataset_path")


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = opt(-1, "FSDP shard degree; -1 = all ranks left after the other degrees")
    data_parallel_replicate_degree: int = opt(1, "replicas (HSDP when > 1 with sharding, DDP-like when shard = 1)",
                                              min=1)
    tensor_parallel_degree: int = opt(1, "tensor parallel degree", min=1)
    pipeline_parallel_degree: int = opt(1, "pipeline parallel degree", min=1)
    pipeline_parallel_schedule: str = opt("1F1B", "pipeline schedule from torch.distributed.pipelining",
                                          choices=PP_SCHEDULES)
    pipeline_parallel_schedule_csv: str = opt("", "CSV file of actions defining a custom schedule (overrides the name)")
    pipeline_parallel_microbatch_size: int = opt(1, "sequences per pipeline micro-batch", min=1)
    pipeline_parallel_layers_per_stage: int = opt(0, "layers per (virtual) stage; 0 = 1 stage per rank, 2 for "
                                                     "interleaved and V schedules", min=0)
    pipeline_parallel_split_points: list[str] = opt([], "layer indices that start a new stage, e.g. 4,8 (overrides "
                                                        "layers_per_stage)")
    pipeline_parallel_first_stage_less_layers: int = opt(1, "layers the first stage gives up for the embedding", min=0)
    pipeline_parallel_last_stage_less_layers: int = opt(1, "layers the last stage gives up for norm and output", min=0)
    pipeline_parallel_grad_reduce: str = opt("step", "under PP + FSDP, when gradients are reduce-scattered: step = "
                                             "once, after the step's last micro-batch (a stage holds its whole "
                                             "gradients and gathered parameters until then); microbatch = after "
                                             "each micro-batch's backward (only sharded gradients are held; an "
                                             "all-gather and a reduce-scatter per micro-batch); zero-bubble "
                                             "schedules' split backwards reduce at the step's end",
                                             choices=("step", "microbatch"))
    context_parallel_degree: int = opt(1, "context parallel degree: ranks that split each sequence", min=1)
    context_parallel_method: str = opt("allgather", "how context-parallel attention sees the whole sequence: "
                                       "allgather = each rank gathers every rank's keys and values and attends its "
                                       "own queries (traffic per rank grows with the sequence); ulysses = two "
                                       "all-to-alls turn the sequence split into a head split around attention "
                                       "(whole sequences of heads / CP per rank; traffic per rank falls as CP "
                                       "grows; query heads after TP must divide by CP)",
                                       choices=("allgather", "ulysses"))
    expert_parallel_degree: int = opt(1, "MoE models: ranks that split each layer's routed experts, taken from the "
                                      "ranks that route their own tokens (data-parallel shard x CP x TP: a multiple "
                                      "of CP x TP dividing that, and the experts); tokens travel to their experts' "
                                      "rank and back (all-to-all)", min=1)
    expert_fsdp_shard: str = opt("auto", "how FSDP splits routed experts' weights [experts, rows, columns]: "
                                 "experts = whole experts per rank (padded with empty experts when a rank's EP share "
                                 "does not divide by its FSDP group); rows = every expert along its rows (w1, w3: "
                                 "hidden; w2: dim); auto = rows where whole experts would be padded and the rows "
                                 "divide evenly", choices=("auto", "experts", "rows"))
    fsdp_reshard_after_forward: str = opt("default", "free gathered params after forward: default = yes except the "
                                          "root",
                                          choices=("default", "always", "never"))
    disable_loss_parallel: bool = opt(False, "gather vocab-sharded logits before the loss under TP")
    enable_async_tensor_parallel: bool = opt(False, "overlap TP collectives with compute (CUDA + compile)")


@dataclass
class MoE:
    load_balance_rate: float = opt(1e-3, "aux-loss-free balancing: after each optimizer step every expert's "
                                   "selection bias moves this much toward an even load (the sign of its deviation "
                                   "from the mean, tokens counted over all ranks); 0 = off", min=0.0)
    aux_loss_coef: float = opt(0.0, "weight of the sequence-wise balancing loss (DeepSeek V3's); 0 = none", min=0.0)
    grouped_mm: bool = opt(True, "run the experts as grouped GEMMs (torch._grouped_mm) where shapes allow; false = "
                           "one matmul per expert")
    force_balanced: bool = opt(False, "debug: deal tokens to experts round-robin, for benchmarks of an even load")


@dataclass
class Metrics:
    log_freq: int = opt(10, "log every N steps", min=1)
    enable_tensorboard: bool = opt(False, "write TensorBoard events under <dump_folder>/<save_tb_folder>")
    save_tb_folder: str = opt("tb", "TensorBoard folder inside dump_folder")
    enable_wandb: bool = opt(False, "log to Weights & Biases (needs the wandb package)")
    peak_flops: float = opt(0.0, "the FLOP/s per device that mfu divides by (a GPU the datasheet table lacks, a "
                            "fixed CPU figure); 0: a known GPU's datasheet bf16 peak, else a GEMM measured at start "
                            "(0.3 s on each rank)", min=0.0)
    live_memory: bool = opt(False, "log live_peak_gib: the most bytes of live tensors (parameters, gradients, "
                            "optimizer state, activations, buffers) any rank held since the last log, counted op by "
                            "op on every device (what tessera.estimate predicts); slows each step")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(600, "seconds a collective may wait until the first step is done (start-up, "
                                    "checkpoint loading, the first compile)", min=1)
    train_timeout_seconds: int = opt(300, "seconds a collective may wait after that: a stuck or dead rank ends the run "
                                     "with a line naming the step (gloo; NCCL's watchdog aborts with its own), not a "
                                     "hang", min=1)


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "torch.profiler traces every profile_freq steps, one file per rank "
                                 "(<save_traces_folder>/iteration_N/rankR_trace.json: Perfetto, chrome://tracing)")
    save_traces_folder: str = opt("profile_traces", "profiler traces folder inside dump_folder")
    profile_freq: int = opt(10, "profile the last step of every N (the two before it warm the profiler up)", min=3)
    enable_memory_snapshot: bool = opt(False, "CUDA: the allocator's history (a pickle for pytorch.org/memory_viz) "
                                       "every profile_freq steps and when a run dies out of memory; CPU: the "
                                       "profiler's memory timeline (an HTML file) with each trace")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "memory snapshot folder inside dump_folder")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "save and auto-resume DCP checkpoints")
    folder: str = opt("checkpoint", "checkpoint folder inside dump_folder (or an absolute path: checkpoints kept "
                                    "elsewhere)")
    interval: int = opt(500, "save every N steps", min=1)
    keep_latest_k: int = opt(10, "keep this many complete checkpoints; 0 = keep all", min=0)
    async_mode: str = opt("disabled", "overlap saves with training",
                          choices=("disabled", "async", "async_with_pinned_mem"))
    load_step: int = opt(-1, "resume from this step instead of the latest")
    initial_load_path: str = opt("", "checkpoint to start from when the folder is empty")
    initial_load_model_only: bool = opt(True, "take only model weights from initial_load_path")
    initial_load_in_hf: bool = opt(False, "initial_load_path holds Hugging Face safetensors")
    last_save_model_only: bool = opt(True, "final save holds model weights only")
    last_save_in_hf: bool = opt(False, "final save in Hugging Face safetensors")
    export_dtype: str = opt("float32", "dtype of model-only saves", choices=("float32", "bfloat16", "float16"))
    create_seed_checkpoint: bool = opt(False, "write the initialized model as step 0 and exit (one process)")
    exclude_from_loading: list[str] = opt([], "parts not to load: optimizer, train_state, lr_scheduler, dataloader, "
                                              "rng")
    enable_first_step_checkpoint: bool = opt(False, "also save after step 1")
    start_fresh_if_all_damaged: bool = opt(False, "when every checkpoint in the folder is damaged, train from step "
                                           "0 instead of refusing; the damaged ones are moved to its damaged/ "
                                           "folder and kept")
    accept_changed_data: bool = opt(False, "resume the saved data position although training.dataset_path's files "
                                    "or the tokenizer changed since the checkpoint (on purpose, e.g. documents "
                                    "appended); off: such a resume is refused")
    save_on_signal: list[str] = opt(["SIGTERM"], "signals (SIGTERM, SIGUSR1, SIGUSR2) that stop the run after the "
                                    "step in progress, with a checkpoint of it, exit status 143 (for a requeue); "
                                    "empty = the signals' own action")
    signal_grace_seconds: int = opt(30, "seconds the scheduler leaves between its stop signal and its kill (SLURM "
                                    "preemption, Kubernetes, torchrun: about 30; SLURM's --signal=TERM@N at a time "
                                    "limit: N): a stop skips the step's validation and the purge of older "
                                    "checkpoints, and a save longer than this says so", min=1)


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "recompute activations in backward", choices=("none", "full", "selective"))
    selective_ac_option: str = opt("2", "'op' = save selected matmul outputs; an integer N = checkpoint every N-th "
                                        "block")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile the components below")
    components: list[str] = opt(["model", "loss"], "what to compile: model (each block), loss")


@dataclass
class Float8:
    recipe_name: str = opt("tensorwise", "scaling recipe", choices=FLOAT8_RECIPES)
    enable_fsdp_float8_all_gather: bool = opt(False, "all-gather FSDP params in float8")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(False, "one fused amax all-reduce after each optimizer step")
    filter_fqns: list[str] = opt([], "also skip linears whose name contains one of these (the family's output head "
                                 "is always skipped); auto_filter_small_kn skips small GEMMs")
    emulate: bool = opt(False, "emulate float8 matmuls (runs anywhere; for tests)")


@dataclass
class MX:
    recipe_name: str = opt("mxfp8_cublas", f"MX recipe: {', '.join(MX_RECIPES)}")
    filter_fqns: list[str] = opt([], "also skip linears whose name contains one of these (the family's output head "
                                 "is always skipped)")
    emulate: bool = opt(False, "emulate MX matmuls (runs anywhere; for tests)")


@dataclass
class QuantizeLinear:
    float8: Float8 = field(default_factory=Float8)
    mx: MX = field(default_factory=MX)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


LORA_INITS = ("default", "gaussian")


@dataclass
class Lora:
    rank: int = opt(0, "rank of the low-rank adapters beside the target linears; 0: no LoRA, every weight trains. "
                       "With LoRA the base weights are frozen: no gradients, no optimizer state", min=0)
    alpha: float = opt(16.0, "the adapters' output is scaled by alpha / rank", min=0.0)
    dropout: float = opt(0.0, "dropout on the adapters' input while training", min=0.0, max=1.0)
    target_modules: list[str] = opt(["wq", "wk", "wv", "wo"], "linears and expert stacks that get adapters, by the "
                                    "end of their names: wq, attention.wo, feed_forward.w1, experts.w2, ...")
    init: str = opt("default", "A from a Kaiming-uniform (default, as PEFT) or N(0, 1/rank) (gaussian); B is zero, "
                               "so training starts from the base model", choices=LORA_INITS)
    initial_adapter_path: str = opt("", "a PEFT folder (adapter_config.json, adapter_model.safetensors) whose adapters "
                                         "a fresh run starts from, on the base of checkpoint.initial_load_path; its r "
                                         "and lora_alpha must be lora.rank and lora.alpha")
    merge_on_export: bool = opt(False, "Hugging Face exports (checkpoint.last_save_in_hf) fold the adapters into the "
                                       "base weights; otherwise they are a PEFT folder (adapter_config.json, "
                                       "adapter_model.safetensors) for peft to load onto the base model")


@dataclass
class Eval:
    """Downstream tasks of lm-eval-harness on the live model while it trains (tessera.eval), and for
    `python -m tessera.eval` on a checkpoint."""
    tasks: list[str] = opt([], "lm-eval task names, or paths of task YAML files (their folders are searched for "
                           "the tasks they include); empty: no evaluation")
    interval: int = opt(0, "evaluate every N steps while training, and at the end; 0: at the end only", min=0)
    limit: int = opt(0, "examples per task; 0: all of them", min=0)
    batch_size: int = opt(8, "sequences per forward, per data-parallel rank (under PP: training.local_batch_size)",
                          min=1)
    num_fewshot: int = opt(0, "examples of the task put before each question; 0: the task's own number (most: "
                           "none)", min=0)
    max_gen_toks: int = opt(64, "tokens a generation task samples at most (a task's own max_gen_toks wins)",
                            min=1)


@dataclass
class Generate:
    prompt: str = opt("", "text to continue (python -m tessera.generate); after the tokenizer's BOS")
    prompt_ids: list[str] = opt([], "token ids to continue instead of prompt, e.g. 1,2,3")
    max_new_tokens: int = opt(64, "tokens to sample at most (fewer when EOS comes)", min=1)
    temperature: float = opt(0.8, "softmax temperature; 0 = greedy", min=0.0)
    top_k: int = opt(0, "sample among the k most likely tokens; 0 = all", min=0)
    top_p: float = opt(1.0, "sample among the most likely tokens holding this much probability", min=0.0, max=1.0)
    seed: int = opt(0, "seed of the sampling", min=0, max=2**63 - 1)
    device: str = opt("auto", "where to run; auto = cuda when there is one, else cpu", choices=("auto", "cpu", "cuda"))
    json: bool = opt(False, "print {prompt_ids, output_ids, text} as JSON instead of the text")
    ignore_eos: bool = opt(False, "sample max_new_tokens whatever comes (benchmarks, parity checks); otherwise stop "
                           "after the model's EOS (a Hugging Face folder's eos_token_id, else the tokenizer's)")


@dataclass
class FaultTolerance:
    """Replica groups under torchft: each group is one ordinary launch; gradients are averaged over the live
    groups every step (or, semi-synchronously, the weights every sync_steps), a dead group drops out of the quorum
    and a relaunched one recovers from a live peer."""
    enable: bool = opt(False, "run this launch as one replica group of a fault-tolerant job (torchft): per-step "
                       "quorum over the live groups through the lighthouse; needs the torchft package")
    replica_id: int = opt(0, "this group's id, 0 .. group_size - 1, unique among the live groups; it picks the "
                          "group's share of the data (and its logs: <job.dump_folder>/replica_<id>)", min=0)
    group_size: int = opt(1, "replica groups in the job: the global batch is dealt to this many groups x the "
                          "data-parallel degree inside one", min=1)
    min_replica_size: int = opt(1, "a step commits only when at least this many groups are in its quorum; below "
                                "it the live groups compute but apply nothing until another group joins", min=1)
    lighthouse: str = opt("", "the torchft lighthouse's address, e.g. http://host:29510; empty = the "
                          "TORCHFT_LIGHTHOUSE environment variable")
    job_name: str = opt("", "the job this group belongs to (letters, digits, . _ -), part of its torchft replica id: "
                        "a group whose job or settings differ from its quorum's is refused before anything is "
                        "copied; empty = a fingerprint of the settings every group must agree on")
    timeout_seconds: int = opt(60, "seconds a cross-group collective, the commit vote or a recovery transfer may "
                               "take before the step is dropped (a dead peer is usually noticed at once)", min=1)
    quorum_timeout_seconds: int = opt(120, "seconds to wait for a quorum (the lighthouse must answer)", min=1)
    sync_wait_seconds: int = opt(3600, "semi-synchronous groups: seconds a group waits at a sync for the other "
                                 "live groups to reach it (a relaunched group, at its first, for their next sync: up "
                                 "to sync_steps of their steps), in place of quorum_timeout_seconds", min=1)
    connect_timeout_seconds: int = opt(10, "seconds to reach the lighthouse and the groups' managers", min=1)
    bucket_mb: int = opt(25, "gradients are averaged across groups in flat buckets of about this size", min=1)
    log_state_digest: bool = opt(False, "debug: log ft/state_digest (a hash of this rank's weights and optimizer "
                                 "state) with the metrics, to compare groups bit for bit")
    semi_sync_method: str = opt("none", "none = average gradients over the groups every step; local_sgd = each "
                                "group steps on its own and the weights are averaged every sync_steps; diloco = the "
                                "same, but the averaged change since the last sync (the pseudo-gradient) is applied "
                                "by an outer SGD (outer_lr, outer_momentum, outer_nesterov)",
                                choices=("none", "local_sgd", "diloco"))
    sync_steps: int = opt(20, "local_sgd / diloco: inner steps between two syncs of the whole model (with "
                          "num_fragments > 1 one fragment syncs every sync_steps / num_fragments steps)", min=1)
    num_fragments: int = opt(1, "diloco: the model is synced in this many fragments of consecutive layers (the "
                             "embedding with the first, the norm and output head with the last), one after the "
                             "other (Streaming DiLoCo); it divides sync_steps", min=1)
    fragment_sync_delay: int = opt(0, "diloco: a fragment's pseudo-gradient is sent this many inner steps before "
                                   "it is applied, overlapping the transfer with training; below sync_steps / "
                                   "num_fragments", min=0)
    fragment_update_alpha: float = opt(0.0, "diloco: a synced fragment becomes (1 - alpha) x the outer optimizer's "
                                       "result + alpha x the group's own weights", min=0.0, max=1.0)
    outer_lr: float = opt(0.7, "diloco: the outer SGD's learning rate on the averaged pseudo-gradient", min=0.0)
    outer_momentum: float = opt(0.9, "diloco: the outer SGD's momentum", min=0.0, below=1.0)
    outer_nesterov: bool = opt(True, "diloco: Nesterov momentum for the outer SGD")
    should_quantize: bool = opt(False, "diloco: all-reduce the pseudo-gradients in fp8 (torchft's quantized "
                                "all-reduce: CUDA with triton)")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    moe: MoE = field(default_factory=MoE)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    lora: Lora = field(default_factory=Lora)
    eval: Eval = field(default_factory=Eval)
    generate: Generate = field(default_factory=Generate)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)


# Options that are gone: a config that still sets one loads, with one warning line saying why it is ignored.
REMOVED = {"parallelism.context_parallel_rotate_method": "context parallelism rotates nothing around a ring (see "
                                                         "parallelism.context_parallel_method); remove the key"}


def mount(families: Mapping[str, type], model_names: tuple[str, ...], module: str) -> type:
    """The whole schema: JobConfig with each family's options (a dataclass of `opt` fields) as a section named after
    the family, and model.name choosing among `model_names`. The registry above this package calls it, so that the
    schema knows no family; `module` is where it puts the classes made (for pickle)."""
    meta = {**Model.__dataclass_fields__["name"].metadata, "choices": model_names}
    model = make_dataclass("Model", [("name", str, field(default=Model.name, metadata=meta))], bases=(Model,))
    sections = [("model", model, field(default_factory=model))]
    sections += [(name, options, field(default_factory=options)) for name, options in families.items()]
    whole = make_dataclass("JobConfig", sections, bases=(JobConfig,))
    model.__module__ = whole.__module__ = module
    return whole
