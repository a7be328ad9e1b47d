"""LoRA adapters made by Hugging Face peft on the tiny transformers models of hf_models.py, and what peft
computes with them.

    python scripts/reference/peft_models.py OUT_DIR

For gpt2 (c_attn, c_proj, c_fc: GPT-2's Conv1D layout, fan_in_fan_out) and llama_gqa (q_proj, v_proj,
down_proj), OUT_DIR/<case>_lora/ is the adapter folder peft's save_pretrained writes (adapter_config.json,
adapter_model.safetensors), on the base folder OUT_DIR/<case>/ (hf_models.py's, written first). B is made
non-zero (peft starts it at zero) so that every adapter gradient is. OUT_DIR/<case>_lora.safetensors holds:
  input, target        the batch of hf_models.py's case
  logits, loss         peft's on it (loss: mean cross-entropy, no shift)
  grad/<peft name>     the gradient of that loss for each adapter parameter
  merged/<hf name>     merge_and_unload()'s weight of each adapted module
Nothing here is computed by memtrain.
"""
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

CASES = {"gpt2": ["c_attn", "c_proj", "c_fc"], "llama_gqa": ["q_proj", "v_proj", "down_proj"]}


def main():
    out = sys.argv[1]
    torch.set_num_threads(1)
    for case, targets in CASES.items():
        base = os.path.join(out, case)
        ref = load_file(os.path.join(out, case + ".safetensors"))
        torch.manual_seed(4321)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM",
                            fan_in_fan_out=case == "gpt2")
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
        folder = os.path.join(out, case + "_lora")
        shutil.rmtree(folder, ignore_errors=True)
        peft_model.save_pretrained(folder)
        peft_model.train()
        logits = peft_model(input_ids=ref["input"]).logits
        vocab = logits.shape[-1]
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), ref["target"].reshape(-1))
        loss.backward()
        tensors = {"input": ref["input"], "target": ref["target"], "logits": logits.detach().contiguous(),
                   "loss": loss.detach()}
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                tensors["grad/" + name.replace(".default", "")] = p.grad.detach().contiguous()
        merged = peft_model.merge_and_unload()
        for name, p in merged.named_parameters():
            if any(("." + t + ".") in name for t in targets):
                tensors["merged/" + name] = p.detach().contiguous()
        save_file(tensors, os.path.join(out, case + "_lora.safetensors"))
    print("wrote peft reference adapters to %s" % out)


if __name__ == "__main__":
    main()
