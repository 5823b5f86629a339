"""The policy a run publishes: the mean of its LoRA over the last steps (tail averaging).

    tail = TailAverage(first_step, rank)
    published, metrics = tail.after_step(step, lora_state)   # after every step: the policy to publish

The greedy policy sits on near-ties that each update's noise tips one way or the other, so the last
step's policy is one draw from the run's recent ones, not their best. The learning rate's decay to
0 (config.lr_schedule) quiets the last updates; averaging the policies of the last steps
(Polyak-Ruppert tail averaging) removes more of the noise; `--average-frac 0` publishes the last
policy. Rollouts and updates stay on the current policy (on-policy); the average is what the run
evaluates, exports and serves from the first step of its last `average_frac` on.

A LoRA delta is s B A (s = PEFT's alpha / r, the same for every step of a run), so the mean of n
deltas is itself a LoRA of rank n r:

    mean_n = s/n sum_i B_i A_i = s [B_1 ... B_n] / n @ [A_1; ...; A_n]

The engine and the exports take rank r, so the mean is kept as its best rank-r approximation
(Eckart-Young), updated once a step:

    M_n = trunc_r( (n-1)/n M_{n-1} + 1/n B_n A_n )

The sum inside has rank 2r, and truncating a product of thin factors is cheap: a QR of each
stacked factor and an SVD of the 2r x 2r core between them, never the full out x in matrix.
Consecutive policies are close, so little is dropped; what is, as a share of the mean's norm, is
logged (`average_dropped`). The mean of the factors (mean A, mean B) would be cheaper still but is
not the mean of the deltas: it holds the cross terms B_i A_j.
"""

import torch

LORA_A, LORA_B = ".lora_A.", ".lora_B."


def truncate(b: torch.Tensor, a: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The best rank-`rank` approximation of b @ a (b: out x k, a: k x in, k >= rank) as factors
    (b', a') of that rank, with the squared norms of what it drops and of b @ a itself."""
    q_b, r_b = torch.linalg.qr(b)      # b = q_b r_b,   q_b: out x k with orthonormal columns
    q_a, r_a = torch.linalg.qr(a.T)    # a = r_a^T q_a^T
    u, s, vh = torch.linalg.svd(r_b @ r_a.T, full_matrices=False)  # b a = q_b (u s vh) q_a^T: its SVD
    root = s[:rank].sqrt()
    b_new = (q_b @ u[:, :rank]) * root            # out x rank
    a_new = root[:, None] * (vh[:rank] @ q_a.T)   # rank x in (the singular values split evenly)
    if len(root) < rank:  # a module narrower than the rank: b a has fewer singular values; pad with 0
        b_new = torch.cat([b_new, b_new.new_zeros(b_new.shape[0], rank - len(root))], dim=1)
        a_new = torch.cat([a_new, a_new.new_zeros(rank - len(root), a_new.shape[1])], dim=0)
    return b_new.contiguous(), a_new.contiguous(), float(s[rank:].pow(2).sum()), float(s.pow(2).sum())


class TailAverage:
    """The running mean of a run's LoRA states from `first_step` on, at the adapters' own rank.

    `add` after every step whose number is >= first_step (the same on every rank: each holds the
    full LoRA state, policy.gather_lora_state); `state` is then an adapter's state dict, as PEFT
    saves it, that the engine and exports take like any other."""

    def __init__(self, first_step: int, rank: int, state: dict | None = None, count: int = 0):
        self.first_step, self.rank = first_step, rank
        self.state, self.count = state, count
        self.dropped = 0.0  # the last update's truncation: ||dropped|| / ||mean||, summed over modules

    def active(self, step: int) -> bool:
        """Whether the policy published after `step` is the average (else it is the current one)."""
        return step >= self.first_step and self.count > 0

    def after_step(self, step: int, lora_state: dict) -> tuple[dict, dict]:
        """The LoRA after step number `step` joins the mean once the tail has begun. Returns the
        policy to publish (the mean once active, else `lora_state`) and the step's metric."""
        if step < self.first_step:
            return lora_state, {}
        self.add(lora_state)
        return self.state, {"average_dropped": self.dropped}

    def add(self, lora_state: dict):
        """M_n = trunc_r((n-1)/n M_{n-1} + 1/n B_n A_n), module by module."""
        self.count += 1
        if self.state is None:
            self.state = {name: tensor.clone() for name, tensor in lora_state.items()}
            return
        n, mean, dropped, total = self.count, {}, 0.0, 0.0
        for name_a in (name for name in lora_state if LORA_A in name):
            name_b = name_a.replace(LORA_A, LORA_B)
            b = torch.cat([self.state[name_b] * ((n - 1) / n), lora_state[name_b] / n], dim=1)
            a = torch.cat([self.state[name_a], lora_state[name_a]], dim=0)
            mean[name_b], mean[name_a], lost, norm = truncate(b, a, self.rank)
            dropped, total = dropped + lost, total + norm
        if len(mean) != len(lora_state):
            raise ValueError("a LoRA state holds tensors other than lora_A and lora_B: it cannot be averaged")
        self.state, self.dropped = mean, (dropped / max(total, 1e-30)) ** 0.5
