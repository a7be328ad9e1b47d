#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "helpers.h"
#include "memtrain/core/safetensors.h"

namespace memtrain {
namespace {

TEST(Safetensors, CorruptHeadersAreErrorsNotCrashes) {
  test::TempDir dir;
  auto write = [&](const std::string& header, const std::string& data) {
    std::string bytes(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(bytes.data(), &n, 8);
    return dir.file("bad.safetensors", bytes + header + data);
  };
  // Offsets that wrap around, a range past the data, a shape that does not fit, a header that lies.
  auto msg = test::error_of([&] {
    load_safetensors(write(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,0]}})", "12345678"));
  });
  EXPECT_NE(msg.find("tensor 'a' claims bytes"), std::string::npos) << msg;
  msg = test::error_of([&] {
    load_safetensors(write(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", "12345678"));
  });
  EXPECT_NE(msg.find("tensor 'a' claims bytes [0, 16) of 8"), std::string::npos) << msg;
  msg = test::error_of([&] {
    load_safetensors(write(R"({"a":{"dtype":"F32","shape":[1000000000000],"data_offsets":[0,8]}})", "12345678"));
  });
  EXPECT_NE(msg.find("impossible shape"), std::string::npos) << msg;
  msg = test::error_of([&] { load_safetensors(write(R"({"a":{"dtype":"F32"}})", "")); });
  EXPECT_NE(msg.find("malformed header at 'a'"), std::string::npos) << msg;
  msg = test::error_of([&] { load_safetensors(dir.file("short.safetensors", std::string("\xff\xff\xff\xff\0\0\0\0x", 9))); });
  EXPECT_NE(msg.find("corrupt header length"), std::string::npos) << msg;
}

TEST(Safetensors, RoundTripAndChecksum) {
  test::TempDir dir;
  std::map<std::string, torch::Tensor> t = {{"a", torch::randn({3, 4})}, {"b", torch::arange(5, torch::kLong)}};
  save_safetensors(dir.path("w.safetensors"), t);
  auto back = load_safetensors(dir.path("w.safetensors"));
  EXPECT_TRUE(torch::equal(back.at("a"), t.at("a")));
  EXPECT_TRUE(torch::equal(back.at("b"), t.at("b")));
  {  // flip one data byte at the end: the CRC catches it
    std::fstream f(dir.path("w.safetensors"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  auto msg = test::error_of([&] { load_safetensors(dir.path("w.safetensors")); });
  EXPECT_NE(msg.find("checksum mismatch"), std::string::npos) << msg;
}

}  // namespace
}  // namespace memtrain
