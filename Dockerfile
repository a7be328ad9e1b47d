# memtrain on an NVIDIA CUDA 13.0 base (Ubuntu 24.04, cuDNN 9): the same set-up script as the README's
# commands, so the image and a bare machine build the same way.
#   docker build -t memtrain .
#   docker run --gpus all memtrain build/memtrain --config examples/configs/gpt2_124m_gpu.ini
#   docker run memtrain scripts/test.sh
FROM nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    MEMTRAIN_CACHE=/opt/memtrain-cache \
    TORCH_CUDA_ARCH_LIST=9.0
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        python3 python3-venv ca-certificates sudo && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/memtrain
COPY . .
# Packages, the torch==2.11.0 venv, the data (Jane Austen, Fashion-MNIST) and the build, all in one step.
RUN scripts/setup.sh
CMD ["scripts/train.sh"]
