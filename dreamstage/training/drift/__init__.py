"""Drift: the base's answers on anchor prompts, how far an adapter moves them, and the guard.

- `anchors`: the shipped anchor prompts (measured and rehearsed halves);
- `decoding`: forced, greedy and sampled decodes on one sequence, and the context's adapter switch;
- `records`: the base's record of one anchor (AnchorBase) and how it is made;
- `measure`: the drift figures (Drift), the noise margin and the probe that runs it all in engine steps;
- `rehearsal`: the regularizer's windows made of the records, and which anchors each epoch visits;
- `neighbours`: questions the base writes beside a job's own prompts, rehearsed too;
- `stopping`: the early stop on a job's own windows and their hold through rehearsal-only epochs;
- `guard`: one job's guard, which puts the above together, and the promotion rule.
"""
