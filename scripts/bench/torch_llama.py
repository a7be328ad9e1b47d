#!/usr/bin/env python3
"""The Python side of the Llama benchmark: transformers' LlamaForCausalLM (SDPA attention), trained eagerly
with torch.optim.AdamW(fused=True), fp32, on random tokens; the loss is cross-entropy of the full logits
against the next tokens, as memtrain's plain head computes it.

  torch_llama.py --n_layer 4 --n_head 4 --n_kv_head 2 --n_embd 128 --ffn 384 --block_size 128 --vocab 8192 \
                 --micro_batch 16 --steps 20 [--checkpoint]
Prints one JSON line: median ms/step over the steps after the warm-up, and the process's peak RSS (bytes).
"""
import argparse, json, resource, statistics, time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


def build_llama(a):
    """transformers' LlamaForCausalLM of the benchmark's shape (argparse fields), SDPA attention, untied head."""
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.n_embd, intermediate_size=a.ffn, num_hidden_layers=a.n_layer,
                      num_attention_heads=a.n_head, num_key_value_heads=a.n_kv_head, max_position_embeddings=a.block_size,
                      tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(cfg)


def adamw(params, fused):
    """memtrain's AdamW settings: weight decay 0.1 on matrices only, lr 1e-4, betas (0.9, 0.95)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-4, betas=(0.9, 0.95), fused=fused)


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn=384, block_size=128, vocab=8192, micro_batch=16,
                     steps=20, warmup=3, threads=0).items():
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--lora_rank", type=int, default=0)       # peft LoRA on --lora_targets, the base frozen
    ap.add_argument("--lora_targets", default="q_proj,v_proj")
    ap.add_argument("--qlora", action="store_true")  # the frozen block linears in torchao's NF4 (whole groups only)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build_llama(a)
    model.train()
    if a.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.lora_rank:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, lora_dropout=0.0,
                                                 target_modules=a.lora_targets.split(","), task_type="CAUSAL_LM"))
        model.train()
    base_bytes = 0
    if a.qlora:
        base_bytes = quantize_base(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(trainable, fused=True)
    g = torch.Generator().manual_seed(1)
    times = []
    for step in range(a.steps):
        x = torch.randint(0, a.vocab, (a.micro_batch, a.block_size + 1), generator=g)
        x, y = x[:, :-1], x[:, 1:]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, a.vocab).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        loss.item()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable if p.grad is not None)
    print(json.dumps({"ms_per_step": 1000 * statistics.median(times), "optimizer_state_bytes": state, "grad_bytes": grads,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "parameters": sum(p.numel() for p in model.parameters()), "nf4_bytes": base_bytes}))


def quantize_base(model):
    """QLoRA as torchtune builds it: every frozen nn.Linear of the blocks whose weight is whole NF4 groups (64 x 256
    values) becomes torchao's NF4Tensor of its bf16 values, run through linear_nf4. torchao is imported only now:
    peft, imported before, would otherwise find it and import names torchao 0.18 no longer has."""
    import os, sys
    sys.path.insert(0, os.environ.get("MEMTRAIN_TORCHAO", os.path.join(os.path.dirname(sys.prefix), "torchao0.18.0")))
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

    class FrozenNF4Linear(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.weight = to_nf4(linear.weight.detach().to(torch.bfloat16))
            self.bias = linear.bias

        def forward(self, x):
            y = linear_nf4(x, self.weight)
            return y if self.bias is None else y + self.bias

    packed = 0
    for path, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or path.endswith("lm_head") or module.weight.requires_grad:
            continue
        if module.weight.numel() % (64 * 256):
            continue
        parent, leaf = model.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
        q = FrozenNF4Linear(module)
        setattr(parent, leaf, q)
        w = q.weight
        packed += sum(t.numel() * t.element_size() for t in (w.quantized_data, w.quantized_scalers,
                                                           w.quantization_factor, w.scaler_mean))
    return packed


if __name__ == "__main__":
    main()
