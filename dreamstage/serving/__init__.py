"""Serving: the resident model, the engine thread that decodes every slot, sampling and chat templates.

- `resident`: `ResidentModel`, the one llama_model and llama_context of the process;
- `engine`: `Engine`, the thread that owns every llama call, in parts of one role each: `slots`, `core`,
  `pool` (K/V cells, the lent sequence), `admission`, `batch`, `embeddings`;
- `generation`: a generation request, its events and its text stream (data only, no llama calls);
- `sampling`: sampling parameters and the llama sampler chain;
- `chat`: the GGUF's chat template.
"""
