"""A small transformer language model and its data, for the synthesizer's real training."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """GPT-style decoder: token and position embeddings, pre-norm blocks, untied head."""

    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 2, heads: int = 4, seq: int = 32,
                 batch_norm: bool = False):
        super().__init__()
        self.seq = seq
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        # a BatchNorm over the embedding's features: module buffers (running_mean,
        # running_var float32, num_batches_tracked int64) that DDP broadcasts every forward
        self.bn = nn.BatchNorm1d(d) if batch_norm else None
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        if self.bn is not None:
            x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))

    def loss(self, batch):
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


MODEL_SIZES = {
    # name: (vocab, d, layers, heads, seq)
    "tiny": (256, 32, 2, 2, 16),       # ~38 K parameters: unit tests
    "small": (512, 64, 2, 4, 32),      # ~170 K
    "default": (2048, 192, 4, 4, 64),  # ~2.6 M: the README demo
    "medium": (8192, 512, 2, 8, 32),   # ~15 M: buckets of 25 MB and more
}
# "<size>-bn": the same with a BatchNorm after the embeddings (module buffers)
MODEL_SIZES.update({f"{k}-bn": v for k, v in list(MODEL_SIZES.items()) if k in ("tiny", "small")})


def build_model(size: str, seed: int) -> TinyLM:
    vocab, d, layers, heads, seq = MODEL_SIZES[size]
    torch.manual_seed(seed)
    return TinyLM(vocab, d, layers, heads, seq, batch_norm=size.endswith("-bn"))


def shard_batches(model: TinyLM, rank: int, iteration: int, seed: int, batch: int = 4) -> torch.Tensor:
    """Rank `rank`'s batch at `iteration`: a different shard of a learnable token stream.

    Sequences follow x[i+1] = (a*x[i] + c) mod vocab with per-sequence (a, c), so the
    loss really falls as the model trains."""
    vocab = model.head.out_features
    g = torch.Generator().manual_seed(seed * 1_000_003 + iteration * 1009 + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    a = torch.randint(1, 8, (batch, 1), generator=g)
    c = torch.randint(0, vocab, (batch, 1), generator=g)
    seq = [start]
    for _ in range(model.seq):
        seq.append((a * seq[-1] + c) % vocab)
    return torch.cat(seq, dim=1)
