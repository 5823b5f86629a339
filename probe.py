"""The policy probe: how far each update moved the policy's first action on fixed held-out states.

    probe = PolicyProbe(chat, held_out_tasks)
    metrics = probe.measure(engine, lora_request)     # after each sync: probe_kl, probe_flip_frac

A step's loss and gradient norm say little about what the update did to the policy's choices; the
probe asks the engine, after each sync, for its distribution over the action on the same states,
and compares it with the previous sync's.
"""

import math

import rollout
import vllm_engine


class PolicyProbe:
    """How far one update moved the policy, on fixed held-out states: the first turns of the
    first `n` held-out puzzles, each with the reply begun up to where the task's actions part
    (ChatFormat.action_prefix: `<answer>`), so that the next token is the action (the tiny model's
    replies start with `<answer>` every time: the reply's own first token says nothing). After each
    sync the engine gives its distribution over that token (the top `top` tokens); `measure`
    returns, against the previous sync's, the mean KL(before || after) over the states and the
    share of them whose most likely action changed (the greedy action flipped). Both distributions
    are taken over the union of the two top-`top` sets, a token outside one's top set at that set's
    smallest probability (an upper bound), renormalised: exact when the top sets hold nearly all
    the mass, as an action does. Cheap: n prompts, one token each. (A real model's action may take
    several tokens; its first is probed.)"""

    def __init__(self, chat: rollout.ChatFormat, tasks: list, top: int = 20):
        self.prompts = []
        for task in tasks:
            game = task.clone()
            obs = game.reset()
            turn = chat.open_turn(game.first_text(obs), obs.image, game)
            self.prompts.append({"prompt_token_ids": turn.prompt_ids + chat.action_prefix(game),
                                 "multi_modal_data": {"image": [obs.image]}})
        self.top, self.banned, self.previous = top, chat.banned_token_ids, None

    def distributions(self, engine, lora_request) -> list[dict] | None:
        from vllm import SamplingParams

        if not self.prompts:  # probe_states 0: off
            return None
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=self.top, detokenize=False,
                                logit_bias=vllm_engine.sampling_logit_bias(self.banned))
        outputs = engine.generate(self.prompts, params, lora_request=lora_request, use_tqdm=False)
        return [{token: math.exp(lp.logprob) for token, lp in out.outputs[0].logprobs[0].items()} for out in outputs]

    def measure(self, engine, lora_request) -> dict:
        current, before = self.distributions(engine, lora_request), self.previous
        self.previous = current
        if before is None:
            return {}
        kls, flips = [], 0
        for p, q in zip(before, current):
            support = p.keys() | q.keys()
            p_all = {t: p.get(t, min(p.values())) for t in support}
            q_all = {t: q.get(t, min(q.values())) for t in support}
            zp, zq = sum(p_all.values()), sum(q_all.values())
            kls.append(sum(p_all[t] / zp * math.log((p_all[t] / zp) / (q_all[t] / zq)) for t in support))
            flips += max(p, key=p.get) != max(q, key=q.get)
        return {"probe_kl": sum(kls) / len(kls), "probe_flip_frac": flips / len(kls)}
