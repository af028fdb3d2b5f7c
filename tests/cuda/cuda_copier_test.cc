// The CUDA copy engine (src/cuda/cuda_copier.cc) on a real device: known bytes through its
// pinned staging to device memory and back, each pinned-memory mode and stream sharing, the
// loader and the saver driving it, and its errors. Labelled `gpu` in CTest: CPU-only runs
// leave it out by label (ctest -LE gpu); on a machine without a visible device every test
// fails, it does not skip.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/cuda/cuda_copier.h"
#include "reshard/io/rank_file.h"
#include "reshard/runtime/loader.h"
#include "reshard/runtime/rank_writer.h"

namespace reshard {
namespace {

using test::ThrowsError;

// Device memory for a test, freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : ptr_(CudaMalloc(0, bytes)), bytes_(bytes) {}
  ~DeviceBuffer() { CudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* get() const { return static_cast<char*>(ptr_); }
  std::string Read() const {
    std::string out(bytes_, '\0');
    CudaCopyToHost(0, out.data(), ptr_, bytes_);
    return out;
  }

 private:
  void* ptr_;
  size_t bytes_;
};

class CudaCopierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(CudaDeviceCount(), 0) << "no CUDA device visible: this test needs a GPU "
                                       "(CPU-only runs leave the `gpu` label out)";
  }
};

struct Mode {
  PinnedMemory pinned;
  int streams;
};
class CudaCopierModes : public CudaCopierTest, public ::testing::WithParamInterface<Mode> {};

// Every (lane, slot) copies its own pattern into its own part of a device buffer; each slot is
// then reused (after WaitSlot) for a second pattern into another part. What lands must be
// exactly the patterns.
TEST_P(CudaCopierModes, CopiesKnownBytesFromEveryLaneAndSlot) {
  constexpr int kLanes = 3, kSlots = 2;
  constexpr size_t kSlotBytes = (1u << 20) + 4096;
  constexpr size_t kCopy = (1u << 20) + 123;  // not a multiple of anything
  const Mode mode = GetParam();
  auto copier = MakeCudaCopier(0, kLanes, kSlots, mode.streams, mode.pinned);
  EXPECT_GE(copier->Reserve(kSlotBytes, kLanes), 0.0);
  EXPECT_EQ(copier->Reserve(kSlotBytes, kLanes), 0.0);  // large enough already: no allocation
  DeviceBuffer dev(2 * kLanes * kSlots * kCopy);
  std::string want(2 * kLanes * kSlots * kCopy, '\0');
  for (int round = 0; round < 2; ++round) {
    for (int lane = 0; lane < kLanes; ++lane) {
      copier->BindThread(lane);
      for (int slot = 0; slot < kSlots; ++slot) {
        copier->WaitSlot(lane, slot);
        char* stage = static_cast<char*>(copier->Staging(lane, slot, kSlotBytes));
        ASSERT_NE(stage, nullptr);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(stage) % 4096, 0u) << "O_DIRECT reads land in staging";
        const size_t at = ((round * kLanes + lane) * kSlots + slot) * kCopy;
        const std::string bytes = test::PatternBytes(kCopy, 1 + at);
        std::memcpy(stage, bytes.data(), kCopy);
        want.replace(at, kCopy, bytes);
        copier->CopyAsync(lane, slot, dev.get() + at, stage, kCopy);
      }
    }
  }
  copier->Synchronize();
  EXPECT_TRUE(test::SameBytes(dev.Read(), want));
}

INSTANTIATE_TEST_SUITE_P(PinnedAndStreams, CudaCopierModes,
                         ::testing::Values(Mode{PinnedMemory::kRegister, 0}, Mode{PinnedMemory::kHostAlloc, 0},
                                           Mode{PinnedMemory::kRegister, 1}),
                         [](const auto& info) {
                           return std::string(info.param.pinned == PinnedMemory::kRegister ? "Register" : "HostAlloc") +
                                  (info.param.streams == 1 ? "OneStream" : "StreamPerLane");
                         });

TEST_F(CudaCopierTest, CopiesDeviceBytesBackIntoStaging) {
  constexpr size_t kBytes = 300000;
  auto copier = MakeCudaCopier(0, 1, 2);
  copier->Reserve(kBytes, 1);
  DeviceBuffer dev(kBytes);
  const std::string bytes = test::PatternBytes(kBytes, 7);
  char* up = static_cast<char*>(copier->Staging(0, 0, kBytes));
  std::memcpy(up, bytes.data(), kBytes);
  copier->CopyAsync(0, 0, dev.get(), up, kBytes);
  copier->Synchronize();
  char* down = static_cast<char*>(copier->Staging(0, 1, kBytes));
  std::memset(down, 0, kBytes);
  copier->CopyToHostAsync(0, 1, down, dev.get(), kBytes);
  copier->WaitSlot(0, 1);
  EXPECT_TRUE(test::SameBytes(std::string(down, kBytes), bytes));
}

TEST_F(CudaCopierTest, AGrowingReserveCarvesTheStagingAnewAndWarmUpCopiesNothingVisible) {
  auto copier = MakeCudaCopier(0, 2, 2);
  copier->Reserve(8192, 2);
  copier->Reserve(1u << 20, 2);  // larger: allocated anew
  EXPECT_NE(copier->Staging(1, 1, 1u << 20), nullptr);
  EXPECT_EQ(copier->Reserve(4096, 1), 0.0);  // smaller: the block is kept
  copier->Reserve(1u << 20, 2);
  DeviceBuffer dev(1u << 20);
  CudaMemset(0, dev.get(), 0x5a, 1u << 20);
  for (int lane = 0; lane < 2; ++lane) copier->Warm(lane);
  copier->Synchronize();
  EXPECT_EQ(dev.Read(), std::string(1u << 20, '\x5a'));  // warm-up copies go to its own memory
}

TEST_F(CudaCopierTest, BadArgumentsAreErrorsAndLeaveTheCopierUsable) {
  auto copier = MakeCudaCopier(0, 2, 2);
  EXPECT_TRUE(ThrowsError([&] { copier->Staging(0, 0, 4096); }, ErrorCode::kInvalidArgument,
                          {"without Reserve"}));
  copier->Reserve(8192, 2);
  EXPECT_TRUE(ThrowsError([&] { copier->Staging(0, 0, 8193); }, ErrorCode::kInvalidArgument,
                          {"lane 0 slot 0 (8193 bytes)", "without Reserve"}));
  EXPECT_TRUE(ThrowsError([&] { copier->Staging(2, 0, 8192); }, ErrorCode::kInvalidArgument,
                          {"lane 2"}));
  char* stage = static_cast<char*>(copier->Staging(0, 0, 8192));
  DeviceBuffer dev(8192);
  EXPECT_TRUE(ThrowsError([&] { copier->CopyAsync(2, 0, dev.get(), stage, 8192); },
                          ErrorCode::kInvalidArgument, {"lane 2 of a copier of 2 lanes"}));
  EXPECT_TRUE(ThrowsError([&] { copier->CopyAsync(0, 2, dev.get(), stage, 8192); },
                          ErrorCode::kInvalidArgument, {"slot 2 of a lane of 2 slots"}));
  EXPECT_TRUE(ThrowsError([&] { copier->WaitSlot(-1, 0); }, ErrorCode::kInvalidArgument, {"lane -1"}));
  // Still usable: known bytes land.
  const std::string bytes = test::PatternBytes(8192, 3);
  std::memcpy(stage, bytes.data(), bytes.size());
  copier->CopyAsync(0, 0, dev.get(), stage, bytes.size());
  copier->Synchronize();
  EXPECT_TRUE(test::SameBytes(dev.Read(), bytes));
}

TEST_F(CudaCopierTest, ACopyTheRuntimeRefusesIsAnErrorNamingTheCall) {
  auto copier = MakeCudaCopier(0, 1, 1);
  copier->Reserve(8192, 1);
  char* stage = static_cast<char*>(copier->Staging(0, 0, 8192));
  EXPECT_TRUE(ThrowsError([&] { copier->CopyAsync(0, 0, nullptr, stage, 8192); }, ErrorCode::kIo,
                          {"CUDA error in cudaMemcpyAsync"}));
  // The refusal is not sticky: the next copy lands.
  DeviceBuffer dev(8192);
  const std::string bytes = test::PatternBytes(8192, 5);
  std::memcpy(stage, bytes.data(), bytes.size());
  copier->CopyAsync(0, 0, dev.get(), stage, bytes.size());
  copier->Synchronize();
  EXPECT_TRUE(test::SameBytes(dev.Read(), bytes));
}

TEST_F(CudaCopierTest, BadDevicesAndSizesAreErrors) {
  const int n = CudaDeviceCount();
  EXPECT_TRUE(ThrowsError([&] { MakeCudaCopier(n, 1, 1); }, ErrorCode::kIo, {"cudaSetDevice"}));
  EXPECT_TRUE(ThrowsError([&] { MakeCudaCopier(0, 0, 1); }, ErrorCode::kInvalidArgument,
                          {"at least one lane and one slot"}));
  EXPECT_TRUE(ThrowsError([&] { CudaMalloc(0, size_t{1} << 60); }, ErrorCode::kIo, {"cudaMalloc"}));
  EXPECT_TRUE(ThrowsError([&] { CudaMalloc(n, 4096); }, ErrorCode::kIo, {"cudaSetDevice"}));
}

// The engine as the loader and the saver drive it: a rank file of several tensors (chunk,
// span and tensor boundaries everywhere) loaded into device memory with each read strategy,
// then saved from device memory and loaded back on the host.
TEST_F(CudaCopierTest, LoaderAndSaverMoveEveryByteThroughIt) {
  test::TempDir dir;
  constexpr uint64_t kChunk = 8192;
  const std::vector<uint64_t> sizes = {3 * kChunk + 517, 100, 0, 5 * kChunk, 4, 2 * kChunk + 4};
  RankFileHeader h;
  h.layout_key = "fsdp2-ws1";
  h.world_size = 1;
  h.source = SourceFingerprint::FromSaved({1, 1});
  h.chunk_size = kChunk;
  std::vector<std::string> data;
  std::vector<SaveSource> sources;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TensorEntry e;
    e.name = "t" + std::to_string(i);
    e.dtype = DType::kU8;
    e.global_shape = {sizes[i]};
    e.local_shape = {sizes[i]};
    e.sharded = true;
    e.rows = {0, sizes[i]};
    h.tensors.push_back(e);
    data.push_back(test::PatternBytes(sizes[i], 40 + i));
  }
  for (size_t i = 0; i < sizes.size(); ++i) sources.push_back({h.tensors[i].name, data[i].data(), sizes[i], false});
  const auto path = dir / RankFileName(0, 1);
  SaveRankFile(path, h, sources, nullptr, {});
  const RankFileReader reader = RankFileReader::Open(path);

  for (IoMode io : {IoMode::kBuffered, IoMode::kDirect, IoMode::kReadahead}) {
    for (uint64_t span : {uint64_t{0}, uint64_t{1} << 20}) {
      SCOPED_TRACE("io " + std::to_string(static_cast<int>(io)) + " span " + std::to_string(span));
      LoadOptions o;
      o.io = io;
      o.threads = 3;
      o.span_bytes = o.cold_span_bytes = span;
      auto copier = MakeCudaCopier(0, 3, 2);
      std::vector<std::unique_ptr<DeviceBuffer>> dev;
      std::vector<LoadTarget> targets;
      for (size_t i = 0; i < sizes.size(); ++i) {
        dev.push_back(std::make_unique<DeviceBuffer>(std::max<uint64_t>(sizes[i], 1)));
        CudaMemset(0, dev[i]->get(), 0, std::max<uint64_t>(sizes[i], 1));
        targets.push_back({h.tensors[i].name, dev[i]->get(), sizes[i], true});
      }
      const LoadStats stats = LoadRankFile(reader, targets, copier.get(), o);
      EXPECT_EQ(stats.bytes, 3 * kChunk + 517 + 100 + 5 * kChunk + 4 + 2 * kChunk + 4);
      for (size_t i = 0; i < sizes.size(); ++i) {
        if (sizes[i] == 0) continue;
        EXPECT_TRUE(test::SameBytes(dev[i]->Read(), data[i])) << h.tensors[i].name;
      }
      if (io != IoMode::kBuffered || span == 0) continue;

      // Saved from the device memory just loaded, then loaded on the host: the same bytes.
      std::vector<SaveSource> from_device;
      for (size_t i = 0; i < sizes.size(); ++i) {
        from_device.push_back({h.tensors[i].name, dev[i]->get(), sizes[i], true});
      }
      const auto saved = dir / "saved" / RankFileName(0, 1);
      std::filesystem::create_directories(saved.parent_path());
      SaveOptions so;
      so.staging_bytes = 16384;  // several pieces per tensor
      so.verify_data = true;
      auto save_copier = MakeCudaCopier(0, 1, 2);
      SaveRankFile(saved, h, from_device, save_copier.get(), so);
      const RankFileReader back = RankFileReader::Open(saved);
      std::vector<std::string> host;
      std::vector<LoadTarget> host_targets;
      host.reserve(sizes.size());
      for (size_t i = 0; i < sizes.size(); ++i) {
        host.emplace_back(sizes[i], '\0');
        host_targets.push_back({h.tensors[i].name, host[i].data(), sizes[i], false});
      }
      LoadRankFile(back, host_targets, nullptr, LoadOptions{});
      for (size_t i = 0; i < sizes.size(); ++i) EXPECT_TRUE(test::SameBytes(host[i], data[i])) << i;
    }
  }
}

}  // namespace
}  // namespace reshard
