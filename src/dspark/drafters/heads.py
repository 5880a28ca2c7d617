"""Sequential heads (§3.1) and the confidence head (§3.2.1).

Every head turns (backbone hidden h_k, previous token x_{k-1}, its state) into low-rank bias
features b_k ∈ R^r; the bias logits are W2 b_k. Keeping the bias low-rank lets the loss treat the
draft logits as one matmul, [h_k; b_k] @ [W_lm | W2]ᵀ, which the fused chunked loss exploits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class SequentialHead(nn.Module):
    name = "base"

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.rank = rank
        self.W1 = nn.Embedding(vocab_size, rank)  # previous-token embedding (lookup table)
        self.W2 = nn.Linear(rank, vocab_size, bias=False)  # logit projection
        nn.init.normal_(self.W1.weight, std=0.02)
        nn.init.zeros_(self.W2.weight)  # start as the plain backbone: bias 0

    def init_state(self, n: int, ref: Tensor) -> Tensor | None:
        return None

    def step(self, h: Tensor, prev: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """One position: h [N, d], prev [N] -> (b [N, r], new state)."""
        raise NotImplementedError

    def sequence(self, h: Tensor, prev: Tensor) -> Tensor:
        """Teacher-forced block: h [N, γ, d], prev [N, γ] true previous tokens -> b [N, γ, r]."""
        state = self.init_state(h.shape[0], h)
        out = []
        for k in range(h.shape[1]):
            b, state = self.step(h[:, k], prev[:, k], state)
            out.append(b)
        return torch.stack(out, dim=1)

    def bias_logits(self, b: Tensor) -> Tensor:
        return self.W2(b)


class MarkovHead(SequentialHead):
    """B(x_{k-1}) = W2 W1[x_{k-1}] (eq. 5): memoryless first-order transition bias."""

    name = "markov"

    def step(self, h, prev, state):
        return self.W1(prev), None

    def sequence(self, h, prev):
        return self.W1(prev)


class GatedMarkovHead(SequentialHead):
    """The Markov embedding gated by the backbone state: B = W2(σ(W_g[h; W1 x]) ⊙ W1 x)."""

    name = "gated"

    def __init__(self, vocab_size, hidden_size, rank):
        super().__init__(vocab_size, hidden_size, rank)
        self.gate = nn.Linear(hidden_size + rank, rank)

    def step(self, h, prev, state):
        e = self.W1(prev)
        return torch.sigmoid(self.gate(torch.cat([h, e], dim=-1))) * e, None

    def sequence(self, h, prev):
        e = self.W1(prev)
        return torch.sigmoid(self.gate(torch.cat([h, e], dim=-1))) * e


class RNNHead(SequentialHead):
    """Eq. 6: z = [s_{k-1}; W1 x_{k-1}; h_k]; one linear -> (g, c, o);
    s_k = σ(g) s_{k-1} + (1 - σ(g)) tanh(c); b_k = tanh(o); s_0 = 0."""

    name = "rnn"

    def __init__(self, vocab_size, hidden_size, rank):
        super().__init__(vocab_size, hidden_size, rank)
        self.update = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def init_state(self, n, ref):
        return ref.new_zeros(n, self.rank)

    def step(self, h, prev, state):
        z = torch.cat([state, self.W1(prev), h], dim=-1)
        g, c, o = self.update(z).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        state = g * state + (1 - g) * torch.tanh(c)
        return torch.tanh(o), state


HEADS: dict[str, type[SequentialHead]] = {"markov": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}


class ConfidenceHead(nn.Module):
    """c_k = σ(wᵀ[h_k; W1 x_{k-1}]) (eq. 7): P(token k survives | all before it did). Emits logits;
    the sigmoid (and STS temperatures) are applied by whoever consumes them."""

    def __init__(self, hidden_size: int, prev_dim: int):
        super().__init__()
        self.prev_dim = prev_dim
        self.proj = nn.Linear(hidden_size + prev_dim, 1)

    def forward(self, h: Tensor, prev_embedding: Tensor | None) -> Tensor:
        x = h if prev_embedding is None or self.prev_dim == 0 else torch.cat([h, prev_embedding], dim=-1)
        return self.proj(x).squeeze(-1)
