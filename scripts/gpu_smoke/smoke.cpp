// Uses each dependency of memtrain once: Boost.Program_options, GoogleTest, nlohmann-json, zlib.
#include <boost/program_options.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <zlib.h>

namespace po = boost::program_options;

TEST(Smoke, AllFourDependencies) {
  po::options_description desc("smoke");
  desc.add_options()("steps", po::value<int>()->default_value(3), "steps");
  const char* argv[] = {"smoke", "--steps=7"};
  po::variables_map vm;
  po::store(po::parse_command_line(2, argv, desc), vm);
  po::notify(vm);
  EXPECT_EQ(vm["steps"].as<int>(), 7);

  EXPECT_EQ(nlohmann::json::parse(R"({"a": [1, 2]})")["a"][1].get<int>(), 2);

  const char check[] = "123456789";  // the standard CRC-32 check value
  EXPECT_EQ(crc32(0L, reinterpret_cast<const Bytef*>(check), 9), 0xCBF43926u);
}

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
