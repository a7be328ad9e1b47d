#!/usr/bin/env python3
"""DeepSpeed's own model-state estimators for Llama-3.1-8B on one node of 8 GPUs, for docs/ESTIMATE.md's comparison.

DeepSpeed is not one of memtrain's dependencies; install it beside the venv to rerun this (ops not built):
  pip install --target /tmp/ds --no-deps deepspeed==0.16.4 hjson py-cpuinfo && \
  pip install --target /tmp/ds pydantic psutil msgpack ninja einops
  DS_BUILD_OPS=0 PYTHONPATH=/tmp/ds python scripts/reference/deepspeed_estimate.py
Its "GB" are GiB (it divides by 2**30). Parameters by the model card (8,030,261,248; the largest layer is the
128,256 x 4,096 embedding, as DeepSpeed's all_live variant would find it).
"""
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

P = 8030261248
largest = 128256 * 4096
estimate_zero3_model_states_mem_needs_all_cold(total_params=P, largest_layer_params=largest, num_gpus_per_node=8, num_nodes=1)
estimate_zero2_model_states_mem_needs_all_cold(total_params=P, num_gpus_per_node=8, num_nodes=1)
