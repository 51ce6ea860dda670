"""A plain Hugging Face Trainer script: nothing in it enables moe_plugin. With moe_plugin installed, the "moe" section
of the DeepSpeed JSON given to --deepspeed swaps the model's MoE blocks for moe_plugin's layer (see the README,
"The moe section wherever DeepSpeed starts"); without the section, or with MOE_PLUGIN_DEEPSPEED_HOOK=0, the
model trains on Hugging Face's own blocks.

    torchrun --nproc_per_node 2 examples/deepspeed/hf_trainer_moe.py --deepspeed examples/deepspeed/hf_trainer_moe.json
(CPU: add --use_cpu; the tiny random Mixtral below stands in for from_pretrained(...).)
"""
import torch

try:   # only for environments with fairseq's torchaudio, which cannot load next to torch 2.13: moe_plugin hides it
    import moe_plugin.integrations.transformers  # noqa: F401
except ImportError:
    pass
from transformers import HfArgumentParser, MixtralConfig, MixtralForCausalLM, Trainer, TrainingArguments  # noqa: E402

VOCAB, LENGTH = 61, 13


def dataset(size=256):
    """Sequences t[i+1] = (3 t[i] + 1) mod VOCAB from random starts."""
    starts = torch.randint(0, VOCAB, (size,), generator=torch.Generator().manual_seed(1))
    rows = [starts]
    for _ in range(LENGTH - 1):
        rows.append((3 * rows[-1] + 1) % VOCAB)
    return [{"input_ids": row, "labels": row} for row in torch.stack(rows, dim=1)]


def main():
    defaults = dict(output_dir="hf_trainer_moe_out", per_device_train_batch_size=4, max_steps=40, learning_rate=1e-2,
                    logging_steps=5, save_strategy="no", report_to=[], max_grad_norm=0.0)
    parser = HfArgumentParser(TrainingArguments)
    parser.set_defaults(**defaults)
    (args,) = parser.parse_args_into_dataclasses()
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64))
    Trainer(model=model, args=args, train_dataset=dataset()).train()
    if args.process_index == 0:
        print("MoE blocks:", sorted({type(m).__name__ for m in model.modules() if "moeblock" in type(m).__name__.lower()}))


if __name__ == "__main__":
    main()
