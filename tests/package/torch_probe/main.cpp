#include <torch/cuda.h>
#include <torch/types.h>

#include <iostream>

int main() {
  std::cout << "sum " << torch::ones({2}).sum().item<float>() << ", cuda " << torch::cuda::is_available() << '\n';
}
