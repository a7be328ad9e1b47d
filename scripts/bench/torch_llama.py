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


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn=384, block_size=128, vocab=8192, micro_batch=16,
                     steps=20, warmup=3, threads=0).items():
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--lora_rank", type=int, default=0)       # peft LoRA on --lora_targets, the base frozen
    ap.add_argument("--lora_targets", default="q_proj,v_proj")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.n_embd, intermediate_size=a.ffn, num_hidden_layers=a.n_layer,
                      num_attention_heads=a.n_head, num_key_value_heads=a.n_kv_head, max_position_embeddings=a.block_size,
                      tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(cfg)
    model.train()
    if a.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.lora_rank:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, lora_dropout=0.0,
                                                 target_modules=a.lora_targets.split(","), task_type="CAUSAL_LM"))
        model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), fused=True)
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
                      "parameters": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
