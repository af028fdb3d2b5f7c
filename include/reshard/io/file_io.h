// Thin POSIX file helpers. Every failure throws reshard::Error naming the path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace reshard {

class File {
 public:
  File() = default;
  /// Opens a regular file (symbolic links followed) for reading; a FIFO, device, socket or
  /// directory is refused with kInvalidArgument naming it (never waited on).
  static File OpenRead(const std::filesystem::path& path, bool direct = false);
  /// Creates a new file for writing with permission bits `mode` (less the umask). Whatever is
  /// at `path` is unlinked first, never followed or written through: the file is created
  /// with O_EXCL | O_NOFOLLOW.
  static File Create(const std::filesystem::path& path, unsigned mode = 0644);
  /// The same open file (the same inode, whatever its path names now) opened again for
  /// reading with O_DIRECT, through /proc/self/fd; errors name this file's path. Throws where
  /// the file system refuses O_DIRECT at open (tmpfs) or at the first aligned read, or /proc
  /// is not mounted.
  File ReopenDirect() const;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  uint64_t Size() const;

  /// Reads exactly `size` bytes at `offset`; a short read is kDataLoss ("truncated").
  void PReadExact(void* buf, size_t size, uint64_t offset) const;
  /// Reads up to `size` bytes; returns how many were read (stops at end of file).
  size_t PReadUpTo(void* buf, size_t size, uint64_t offset) const;
  void PWriteExact(const void* buf, size_t size, uint64_t offset) const;
  void Truncate(uint64_t size) const;
  void Sync() const;
  /// Asks the kernel to start writing [offset, offset + size) back to the disk now
  /// (sync_file_range SYNC_FILE_RANGE_WRITE), without waiting: a hint that keeps the disk
  /// busy while later bytes are still being written, instead of leaving them all to the final
  /// Sync(). Errors are ignored here (unsupported file systems); Sync() reports real ones.
  void StartWriteback(uint64_t offset, uint64_t size) const;
  void Close();

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

/// Reads a file opened O_DIRECT (File::OpenRead(path, /*direct=*/true)) into any buffer at any
/// offset: what is 4096-aligned in memory and in the file (a run of whole 4096-byte blocks)
/// goes straight from the disk to the destination; the rest (a misaligned destination or
/// offset, a tail shorter than a block) through this object's aligned bounce buffer, up to
/// kBounce bytes per read however misaligned (one block more is allocated at its first use),
/// and one copy. Bytes past the requested range
/// are read into the bounce buffer only, never into the destination. Not thread-safe: one per
/// thread.
class DirectReader {
 public:
  static constexpr uint64_t kAlign = 4096;
  static constexpr uint64_t kBounce = 4ull << 20;

  /// Exactly `size` bytes at `offset` of `file` into `dst`; fewer (the file ends first) is
  /// kDataLoss naming the file ("truncated"), a failed read kIo.
  void Read(const File& file, void* dst, size_t size, uint64_t offset);
  /// Bytes that went through the bounce buffer (tests check what went straight).
  uint64_t bounced() const { return bounced_; }

 private:
  struct Free {
    void operator()(char* p) const;
  };
  std::unique_ptr<char, Free> bounce_;
  uint64_t bounced_ = 0;
};

/// Each of `files` opened again O_DIRECT (File::ReopenDirect), in order; nothing when one of
/// them cannot be (a file system that refuses O_DIRECT: the caller reads buffered).
std::optional<std::vector<File>> ReopenDirect(const std::vector<const File*>& files);

/// fsync of a directory, so that a rename inside it is durable.
void SyncDirectory(const std::filesystem::path& dir);

/// Writes `contents` to `path` atomically: temporary file (an unpredictable name, created
/// O_EXCL | O_NOFOLLOW) in the same directory with permission bits `mode`, fsync, rename,
/// fsync of the directory.
void WriteFileAtomic(const std::filesystem::path& path, std::string_view contents,
                     unsigned mode = 0644);

/// The permission bits for a copy of `source` (symbolic links followed): 0644 less whatever
/// `source` does not grant, so that a copy is never readable by more users than the source.
unsigned CopyMode(const std::filesystem::path& source);

/// This machine's host name with every character but [A-Za-z0-9._] replaced by '_' ("host"
/// when unknown): part of temporary file names, so that a crashed writer's temporaries can be
/// told from a live one's on another host sharing the directory.
std::string SafeHostName();
/// ".tmp-<host>-<pid>": the suffix of this process's temporary files.
std::string TempSuffix();
/// Whether `owner`, the "<host>-<pid>" part of a temporary's name (or a bare "<pid>" when
/// `bare_pid_is_local`, an older form), names a process of this host that is gone: true only
/// then; another host's, a live process's, or an unreadable owner is never taken for dead.
bool OwnerIsDeadLocalProcess(std::string_view owner, bool bare_pid_is_local);

std::string ReadWholeFile(const std::filesystem::path& path, uint64_t max_size);

/// Fraction of the file's pages in the page cache (mincore over a sample of pages).
double PageCacheResidency(const std::string& path);

/// An exclusive advisory lock (flock) held for the object's lifetime. Waits up to
/// `wait_seconds` for another process to release it, then throws kBusy.
class DirectoryLock {
 public:
  explicit DirectoryLock(const std::filesystem::path& lock_file, double wait_seconds = 0);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

/// A claim on a directory that the processes of one owner share and any other owner is
/// refused while it is held: a flock LOCK_SH on `claim_file` for the object's lifetime, the
/// file naming (line 1) the owner and (line 2) a description of the process that took the
/// claim first. Taken only while holding the directory's DirectoryLock, so that checking the
/// holders and taking the claim cannot interleave with another claimant. A claim file that
/// no process holds is stale and is taken over whoever wrote it (a crashed process's flock
/// is gone with it).
class SharedClaim {
 public:
  SharedClaim() = default;
  /// The claim for `owner` (a single line) with `description` (a single line), or nothing,
  /// with the holders' owner and description in *held_owner / *held_by, when processes of
  /// another owner hold it. A symbolic link or special file at `claim_file` is refused.
  static std::optional<SharedClaim> Take(const std::filesystem::path& claim_file,
                                         const std::string& owner,
                                         const std::string& description,
                                         std::string* held_owner, std::string* held_by);
  SharedClaim(SharedClaim&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  SharedClaim& operator=(SharedClaim&& other) noexcept;
  SharedClaim(const SharedClaim&) = delete;
  SharedClaim& operator=(const SharedClaim&) = delete;
  ~SharedClaim();

 private:
  explicit SharedClaim(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace reshard
