"""This project's attention behind other libraries' interfaces, each opt-in:

- `hopper_attn.integrations.transformers.register()`: `attn_implementation="hopper_attn"`
  in Hugging Face transformers (its AttentionInterface).
- `hopper_attn.integrations.sdpa.activate()`: torch's scaled_dot_product_attention runs
  this project's kernels where SDPA picks its flash backend
  (torch.nn.attention.register_flash_attention_impl).

Importing this package imports neither transformers nor anything that changes torch.
"""
