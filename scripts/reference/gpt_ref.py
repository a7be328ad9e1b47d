"""The reference GPT in PyTorch: memtrain's GPT (models/src/gpt.cpp) operation for operation and name
for name. Used by make_fixtures.py (expected values) and scripts/bench/ (the Python side of benchmarks)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc


class Attention(nn.Module):
    def __init__(self, c, dropout):
        super().__init__()
        self.c_attn = nn.Linear(c["n_embd"], 3 * c["n_embd"])
        self.c_proj = nn.Linear(c["n_embd"], c["n_embd"])
        self.resid_drop = nn.Dropout(dropout)
        self.n_head, self.dropout = c["n_head"], dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        heads = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, c, dropout):
        super().__init__()
        self.c_fc = nn.Linear(c["n_embd"], 4 * c["n_embd"])
        self.c_proj = nn.Linear(4 * c["n_embd"], c["n_embd"])
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, c, dropout):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c["n_embd"]), Attention(c, dropout)
        self.ln_2, self.mlp = nn.LayerNorm(c["n_embd"]), MLP(c, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c, dropout=0.0):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.wpe = nn.Embedding(c["block_size"], c["n_embd"])
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(c, dropout) for _ in range(c["n_layer"])])
        self.ln_f = nn.LayerNorm(c["n_embd"])

    def forward(self, idx, targets, checkpoint=False):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = tc.checkpoint(block, x, use_reentrant=False) if checkpoint else block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss
