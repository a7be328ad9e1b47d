# memtrain on an NVIDIA CUDA 13.0 base (Ubuntu 24.04, cuDNN 9): the same set-up script as the README's
# commands, so the image and a bare machine build the same way.
#   docker build -t memtrain .
#   docker run --gpus all memtrain build/memtrain --config examples/configs/gpt2_124m_gpu.ini
#   docker run memtrain scripts/test.sh
# Layers, from the least to the most often changed: Debian packages (scripts/packages.txt, the list
# setup.sh installs too), the torch venv and the prepared data (set-up without the build), then the
# sources and the build. Editing a source file rebuilds only the last layer.
FROM nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    MEMTRAIN_CACHE=/opt/memtrain-cache \
    TORCH_CUDA_ARCH_LIST=9.0
WORKDIR /opt/memtrain

# 1. Packages: the one list, plus what set-up itself needs to run.
COPY scripts/packages.txt scripts/packages.txt
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates \
        $(grep -vE '^\s*(#|$)' scripts/packages.txt) \
 && rm -rf /var/lib/apt/lists/*

# 2. The torch==2.11.0 venv and the data (Jane Austen, its BPE token files, Fashion-MNIST), keyed by set-up and
#    the data scripts.
COPY scripts/setup.sh scripts/prepare_data.py scripts/prepare_tokens.py scripts/
RUN scripts/setup.sh --no-build

# 3. The sources and the build.
COPY . .
RUN scripts/setup.sh
CMD ["scripts/train.sh"]
