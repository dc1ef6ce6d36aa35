"""Placement: where the model's weights run and live beyond the CPU and RAM (docs/design.md
sections 2 and 7): the CUDA-resident model (cuda_model.py) and the VRAM tier of the routed
experts (vram_experts.py). It builds on colibri/models and colibri/io; neither imports it."""
