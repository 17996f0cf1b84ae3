"""DeepSeek V3 (and V2): multi-head latent attention, DeepSeek MoE (sigmoid or softmax scores, group-limited
routing, shared experts, dense first blocks), the shared decoder otherwise."""

from tessera.models.common.counts import check_decoder_layout
from tessera.models.contract import Family
from tessera.models.deepseek.args import mla_qk_clip
from tessera.models.deepseek.counts import counts
from tessera.models.deepseek.v3 import hf
from tessera.models.deepseek.v3.args import FLAVORS, TAKES_TOKENIZER_VOCAB
from tessera.models.deepseek.v3.options import DeepSeekV3Options, check, trains_only

FAMILY = Family(name="deepseek_v3", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=counts, check_layout=check_decoder_layout, embedding="tok_embeddings.weight",
                high_precision=("output", "router"), torch_side="tessera.models.deepseek.v3.spec:SPEC",
                hf_model_type="deepseek_v3", hf_also_reads=hf.ALSO_READS, options=DeepSeekV3Options, check=check,
                moved_options={"training.mtp_loss_weight": "mtp_loss_weight"},
                metrics={"mtp_loss": "mtp", "indexer_loss": "idx"},
                trains_absent_parts=lambda cfg: cfg.deepseek_v3.mtp_loss_weight > 0, qk_clip=mla_qk_clip,
                trains_only=trains_only)
