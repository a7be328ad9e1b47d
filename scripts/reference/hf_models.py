"""Tiny random Hugging Face models, made by transformers itself, and what transformers computes with them.

    python scripts/reference/hf_models.py OUT_DIR

For each case, OUT_DIR/<case>/ is a model folder as save_pretrained writes it (config.json and
safetensors, sharded with model.safetensors.index.json where the case says so), and
OUT_DIR/<case>.safetensors holds a batch and transformers' answers on it, in float32:
  input, target   (2, 12) int64 token ids
  logits          (2, 12, vocab)
  loss            () mean cross-entropy of the logits against target (no shift: memtrain's loss)
  grad/<name>     the gradient of that loss for each parameter, by its checkpoint name
The memtrain tests (tests/models/test_hugging_face.cpp) load the folder and compare; nothing here is
computed by memtrain. A folder of broken variants (bad/) feeds the error tests.
"""
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
import transformers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

VOCAB = 97


def cases():
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    return {
        # GPT-2 with its tied head, Conv1D weights and the causal-mask buffers of older checkpoints.
        "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "6KB", torch.float32),
        # Llama with grouped-query attention (4 query heads share 2 k/v heads) and an untied head.
        "llama_gqa": (LlamaForCausalLM, LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False,
                                                    rope_theta=500.0), "8KB", torch.float32),
        # Qwen2: biases on q, k and v, tied head.
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True,
                                                rms_norm_eps=1e-6), None, torch.float32),
        # Llama 3.1's rope scaling, with an original context short enough that every band of the rule is hit
        # (head dim 8: wavelengths 6.3 (between 16/4 and 16/1: smoothed), 63, 628, 6283 (above: divided)).
        "llama3_rope": (LlamaForCausalLM, LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True,
                                                      rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                    "original_max_position_embeddings": 16}),
                        None, torch.float16),  # stored in fp16
        # Stored in bf16: memtrain converts to its fp32 parameters, the reference runs the same bf16 values in fp32.
        "llama_bf16": (LlamaForCausalLM, LlamaConfig(**common, num_key_value_heads=1, tie_word_embeddings=False),
                       "8KB", torch.bfloat16),
        # Phi-3: q, k, v fused in qkv_proj (4 query heads, 2 k/v heads), gate and up in gate_up_proj; a sliding window
        # of 32 (memtrain caps its context there). No pad token: Phi3Config's 32000 is outside this vocabulary.
        "phi3": (Phi3ForCausalLM, Phi3Config(**common, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=32,
                                             pad_token_id=None, rope_theta=500.0), None, torch.float32),
    }


def write_case(out, name, cls, config, shard, dtype):
    torch.manual_seed(1234)
    config._attn_implementation = "sdpa"
    model = cls(config)
    folder = os.path.join(out, name)
    shutil.rmtree(folder, ignore_errors=True)
    model.to(dtype).save_pretrained(folder, safe_serialization=True,
                                    **({"max_shard_size": shard} if shard else {}))
    model = cls.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    g = torch.Generator().manual_seed(99)
    inp = torch.randint(0, VOCAB, (2, 12), generator=g)
    tgt = torch.randint(0, VOCAB, (2, 12), generator=g)
    logits = model(input_ids=inp).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tgt.reshape(-1))
    loss.backward()
    tensors = {"input": inp, "target": tgt, "logits": logits.detach().contiguous(), "loss": loss.detach()}
    for pname, p in model.named_parameters():
        tensors["grad/" + pname] = p.grad.detach().contiguous()
    save_file(tensors, os.path.join(out, name + ".safetensors"))
    # GPT-2's transformer.h.N.attn.bias masks: older checkpoints hold them; the loader must skip them.
    if name == "gpt2":
        from safetensors.torch import load_file
        path = os.path.join(folder, "model.safetensors.index.json")
        index = json.load(open(path))
        first = sorted(set(index["weight_map"].values()))[0]
        shard_tensors = load_file(os.path.join(folder, first))
        shard_tensors["transformer.h.0.attn.bias"] = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
        save_file(shard_tensors, os.path.join(folder, first), metadata={"format": "pt"})
        index["weight_map"]["transformer.h.0.attn.bias"] = first
        json.dump(index, open(path, "w"))


def write_bad(out):
    """Broken copies of llama_gqa: each a folder the loader must refuse with its own message."""
    src = os.path.join(out, "llama_gqa")
    bad = os.path.join(out, "bad")
    shutil.rmtree(bad, ignore_errors=True)
    os.makedirs(bad)

    def copy(name):
        dst = os.path.join(bad, name)
        shutil.copytree(src, dst)
        return dst

    os.remove(os.path.join(copy("no_config"), "config.json"))
    d = copy("unknown_type")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["model_type"] = "falcon"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    d = copy("yarn_rope")
    cfg["model_type"] = "llama"
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    d = copy("missing_shard")
    os.remove(os.path.join(d, "model-00002-of-%05d.safetensors" % shards(d)))
    d = copy("wrong_shape")
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["intermediate_size"] = 80
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    d = copy("truncated")
    last = os.path.join(d, "model-%05d-of-%05d.safetensors" % (shards(d), shards(d)))
    size = os.path.getsize(last)
    with open(last, "r+b") as f:
        f.truncate(size - 100)
    d = copy("unexpected_tensor")
    from safetensors.torch import load_file
    first = os.path.join(d, "model-00001-of-%05d.safetensors" % shards(d))
    t = load_file(first)
    t["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    save_file(t, first, metadata={"format": "pt"})


    # Phi-3 folders: rope scaling for the 128k models, a partial rotary factor, and a qkv_proj with rows no
    # projection takes.
    def phi3_copy(name, **changes):
        dst = os.path.join(bad, name)
        shutil.copytree(os.path.join(out, "phi3"), dst)
        c = json.load(open(os.path.join(dst, "config.json")))
        c.update(changes)
        json.dump(c, open(os.path.join(dst, "config.json"), "w"))
        return dst
    phi3_copy("phi3_longrope", rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4})
    phi3_copy("phi3_partial_rotary", partial_rotary_factor=0.5)
    d = phi3_copy("phi3_extra_rows")
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    w = t["model.layers.0.self_attn.qkv_proj.weight"]
    t["model.layers.0.self_attn.qkv_proj.weight"] = torch.cat([w, torch.zeros(4, w.shape[1])])
    save_file(t, path, metadata={"format": "pt"})


def shards(folder):
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    return len(set(index["weight_map"].values()))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    for name, (cls, config, shard, dtype) in cases().items():
        write_case(out, name, cls, config, shard, dtype)
    write_bad(out)
    print("wrote Hugging Face reference models (transformers %s) to %s" % (transformers.__version__, out))


if __name__ == "__main__":
    main()
