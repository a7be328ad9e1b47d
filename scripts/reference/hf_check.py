"""What transformers computes with a model folder, for the memtrain tests to compare against.

    python hf_check.py logits FOLDER TENSORS.safetensors
        from_pretrained(FOLDER) on TENSORS' `input`; prints `max_abs_diff D max_abs_ref R` against TENSORS' `logits`,
        then `stored DTYPES`: the dtypes FOLDER's safetensors files hold, as their headers name them (e.g. F32, BF16)
    python hf_check.py val_loss FOLDER TOKENS T COUNT
        the mean cross-entropy over windows i = 0..COUNT-1 of a headerless uint16 token file: input
        tokens[iT : iT+T], target tokens[iT+1 : iT+T+1] (memtrain's validation windows); prints `val_loss L`
    python hf_check.py peft_logits BASE ADAPTER TENSORS.safetensors
        PeftModel.from_pretrained(from_pretrained(BASE), ADAPTER) on TENSORS' `input`; prints as `logits` does
    python hf_check.py pipeline FOLDER PROMPT N
        transformers' text-generation pipeline (the folder's own tokenizer), greedy, N new tokens; prints the text
        after `text: `
"""
import glob
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def load(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model


def stored_dtypes(folder):
    """The dtypes of every tensor in the folder's safetensors files, read from their headers (not converted)."""
    names = set()
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                names.add(f.get_slice(key).get_dtype())
    return ",".join(sorted(names)) or "none"


def main():
    torch.set_num_threads(1)
    what, folder = sys.argv[1], sys.argv[2]
    model = load(folder)
    if what == "peft_logits":
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, sys.argv[3])
        model.eval()
        what = "logits"
        sys.argv = sys.argv[:2] + sys.argv[3:]
    with torch.no_grad():
        if what == "logits":
            t = load_file(sys.argv[3])
            logits = model(input_ids=t["input"].long()).logits
            print("max_abs_diff %.9g max_abs_ref %.9g" % ((logits - t["logits"]).abs().max().item(), logits.abs().max().item()))
            print("stored " + stored_dtypes(folder))
        elif what == "val_loss":
            tokens = torch.from_numpy(np.fromfile(sys.argv[3], dtype=np.uint16).astype(np.int64))
            T, count = int(sys.argv[4]), int(sys.argv[5])
            losses = []
            for i in range(count):
                w = tokens[i * T: i * T + T + 1]
                logits = model(input_ids=w[:-1].unsqueeze(0)).logits
                losses.append(F.cross_entropy(logits[0].float(), w[1:]).item())
            print("val_loss %.9g" % (sum(losses) / len(losses)))
        elif what == "pipeline":
            from transformers import pipeline
            generate = pipeline("text-generation", model=folder)
            out = generate(sys.argv[3], max_new_tokens=int(sys.argv[4]), do_sample=False)[0]["generated_text"]
            print("text: " + out.replace("\n", " "))
        else:
            raise SystemExit("unknown check " + what)


if __name__ == "__main__":
    main()
