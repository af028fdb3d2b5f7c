#include "reshard/io/file_io.h"

#include <unistd.h>

#include <cctype>

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <thread>
#include <cstring>
#include <string>

#include "reshard/base/error.h"

namespace reshard {
namespace {

std::string FileTypeName(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISDIR(m)) return "a directory";
  return "a special file";
}

[[noreturn]] void FailErrno(const std::string& path, const char* what, int err) {
  ErrorCode code = (err == ENOENT || err == ENOTDIR) ? ErrorCode::kNotFound : ErrorCode::kIo;
  Fail(code, path + ": " + what + ": " + std::strerror(err));
}

}  // namespace

File File::OpenRead(const std::filesystem::path& path, bool direct) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; it is
  // cleared again below, once fstat has shown a regular file (symbolic links are followed:
  // the Hugging Face cache is links into blobs/).
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK;
  if (direct) flags |= O_DIRECT;
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) FailErrno(path.string(), "cannot open", errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    FailErrno(path.string(), "cannot stat", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    if (S_ISDIR(st.st_mode)) {
      Fail(ErrorCode::kInvalidArgument, path.string() + ": is a directory, expected a file");
    }
    Fail(ErrorCode::kInvalidArgument,
         path.string() + ": found " + FileTypeName(st.st_mode) +
             ", expected a regular file (or a symbolic link to one)");
  }
  if (::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK & ~O_CLOEXEC) != 0) {
    const int err = errno;
    ::close(fd);
    FailErrno(path.string(), "cannot clear O_NONBLOCK", err);
  }
  return File(fd, path.string());
}

File File::ReopenDirect() const {
  const std::string self = "/proc/self/fd/" + std::to_string(fd_);
  const int fd = ::open(self.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (fd < 0) FailErrno(path_, "cannot open again with O_DIRECT", errno);
  File f(fd, path_);
  // Some file systems take O_DIRECT at open and refuse the reads: one aligned block read now,
  // so that the caller falls back to buffered reads instead of failing a load later.
  void* p = nullptr;
  if (::posix_memalign(&p, DirectReader::kAlign, DirectReader::kAlign) != 0) {
    Fail(ErrorCode::kIo, "out of host memory probing O_DIRECT reads of " + path_);
  }
  const std::unique_ptr<char, decltype(&std::free)> block(static_cast<char*>(p), &std::free);
  if (::pread(f.fd(), block.get(), DirectReader::kAlign, 0) < 0) {
    FailErrno(path_, "O_DIRECT reads refused", errno);
  }
  return f;
}

std::optional<std::vector<File>> ReopenDirect(const std::vector<const File*>& files) {
  std::vector<File> out;
  try {
    for (const File* f : files) out.push_back(f->ReopenDirect());
  } catch (const Error&) {
    return std::nullopt;
  }
  return out;
}

File File::Create(const std::filesystem::path& path, unsigned mode) {
  // Never through what is already at `path`: a symbolic link (or a hard link) planted there
  // would redirect the write outside the directory. The old entry is unlinked (not followed)
  // and a new file created with O_EXCL | O_NOFOLLOW; whoever re-plants one in between makes
  // the create fail, not write elsewhere.
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    const int err = errno;
    if (err == EISDIR || err == EPERM) {
      Fail(ErrorCode::kInvalidArgument,
           path.string() + ": found a directory, expected a file to replace (or nothing)");
    }
    FailErrno(path.string(), "cannot replace", err);
  }
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  static_cast<mode_t>(mode & 0777));
  if (fd < 0) FailErrno(path.string(), "cannot create", errno);
  return File(fd, path.string());
}

unsigned CopyMode(const std::filesystem::path& source) {
  struct stat st;
  if (::stat(source.c_str(), &st) != 0) return 0644;
  return 0644u & static_cast<unsigned>(st.st_mode);
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File::~File() { Close(); }

void File::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

uint64_t File::Size() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) FailErrno(path_, "cannot stat", errno);
  return static_cast<uint64_t>(st.st_size);
}

size_t File::PReadUpTo(void* buf, size_t size, uint64_t offset) const {
  size_t done = 0;
  auto* p = static_cast<char*>(buf);
  while (done < size) {
    ssize_t n = ::pread(fd_, p + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      FailErrno(path_, "read failed", errno);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

void DirectReader::Free::operator()(char* p) const { std::free(p); }

namespace {

// Reads aligned [offset, offset + size) of a file opened O_DIRECT into aligned `buf`: returns
// the bytes read, fewer only where the file ends. A short read ends it (the file's end, or a
// partial block there): asking again from an unaligned position would be EINVAL on kernels
// that check alignment before the end of the file.
size_t DirectPRead(const File& file, char* buf, size_t size, uint64_t offset) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(file.fd(), buf + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      Fail(ErrorCode::kIo, file.path() + ": O_DIRECT read of " + std::to_string(size - done) + " bytes at offset " +
                               std::to_string(offset + done) + " failed: " + std::strerror(err));
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
    if (done % DirectReader::kAlign != 0) break;
  }
  return done;
}

}  // namespace

void DirectReader::Read(const File& file, void* dst, size_t size, uint64_t offset) {
  auto* out = static_cast<char*>(dst);
  const uint64_t first = offset;
  const size_t wanted = size;
  auto truncated = [&](uint64_t at) {
    Fail(ErrorCode::kDataLoss, file.path() + ": truncated: wanted " + std::to_string(wanted) +
                                   " bytes at offset " + std::to_string(first) + ", the file ends at " +
                                   std::to_string(at));
  };
  while (size > 0) {
    if (reinterpret_cast<uintptr_t>(out) % kAlign == 0 && offset % kAlign == 0 && size >= kAlign) {
      const size_t n = size / kAlign * kAlign;
      const size_t got = DirectPRead(file, out, n, offset);
      if (got < n) truncated(offset + got);
      out += n, offset += n, size -= n;
      continue;
    }
    if (!bounce_) {
      void* p = nullptr;
      if (::posix_memalign(&p, kAlign, kBounce + kAlign) != 0) {
        Fail(ErrorCode::kIo, "out of host memory allocating a " + std::to_string(kBounce) +
                                 "-byte buffer for direct reads of " + file.path());
      }
      bounce_.reset(static_cast<char*>(p));
    }
    const uint64_t block = offset / kAlign * kAlign;
    const uint64_t skip = offset - block;
    // Destination and offset equally misaligned: only up to the next block boundary, then
    // both are aligned and the rest goes straight.
    const bool together = (reinterpret_cast<uintptr_t>(out) - offset) % kAlign == 0;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(size, together ? kAlign - skip : kBounce));
    const size_t got = DirectPRead(file, bounce_.get(), AlignUp(skip + n, kAlign), block);
    if (got < skip + n) truncated(block + got);
    std::memcpy(out, bounce_.get() + skip, n);
    bounced_ += n;
    out += n, offset += n, size -= n;
  }
}

void File::PReadExact(void* buf, size_t size, uint64_t offset) const {
  size_t got = PReadUpTo(buf, size, offset);
  if (got != size) {
    Fail(ErrorCode::kDataLoss, path_ + ": truncated: wanted " + std::to_string(size) +
                                   " bytes at offset " + std::to_string(offset) + ", file has " +
                                   std::to_string(got) + " there");
  }
}

void File::PWriteExact(const void* buf, size_t size, uint64_t offset) const {
  size_t done = 0;
  auto* p = static_cast<const char*>(buf);
  while (done < size) {
    ssize_t n = ::pwrite(fd_, p + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      FailErrno(path_, "write failed", errno);
    }
    done += static_cast<size_t>(n);
  }
}

void File::Truncate(uint64_t size) const {
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) FailErrno(path_, "cannot resize", errno);
}

void File::Sync() const {
  if (::fsync(fd_) != 0) FailErrno(path_, "fsync failed", errno);
}

void File::StartWriteback(uint64_t offset, uint64_t size) const {
#ifdef __linux__
  (void)::sync_file_range(fd_, static_cast<off64_t>(offset), static_cast<off64_t>(size),
                          SYNC_FILE_RANGE_WRITE);
#else
  (void)offset, (void)size;
#endif
}

void SyncDirectory(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) FailErrno(dir.string(), "cannot open directory", errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) FailErrno(dir.string(), "fsync of directory failed", err);
}

std::string RandomToken() {
  unsigned char b[8];
  if (::getentropy(b, sizeof b) != 0) {
    const auto t = std::chrono::steady_clock::now().time_since_epoch().count();
    std::memcpy(b, &t, sizeof b);
  }
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char c : b) {
    s += hex[c >> 4];
    s += hex[c & 15];
  }
  return s;
}

void WriteFileAtomic(const std::filesystem::path& path, std::string_view contents, unsigned mode) {
  auto tmp = path;
  // Unpredictable, and created O_EXCL | O_NOFOLLOW (File::Create).
  tmp.replace_filename("." + path.filename().string() + ".tmp-" + std::to_string(::getpid()) +
                       "-" + RandomToken());
  {
    File f = File::Create(tmp, mode);
    try {
      f.PWriteExact(contents.data(), contents.size(), 0);
      f.Sync();
    } catch (...) {
      f.Close();
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      throw;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    FailErrno(path.string(), "cannot rename into place", err);
  }
  SyncDirectory(path.parent_path().empty() ? "." : path.parent_path());
}

std::string ReadWholeFile(const std::filesystem::path& path, uint64_t max_size) {
  File f = File::OpenRead(path);
  uint64_t size = f.Size();
  if (size > max_size) {
    Fail(ErrorCode::kDataLoss, path.string() + ": file size " + std::to_string(size) +
                                   " bytes exceeds the limit of " + std::to_string(max_size));
  }
  std::string s(size, '\0');
  f.PReadExact(s.data(), size, 0);
  return s;
}

DirectoryLock::DirectoryLock(const std::filesystem::path& lock_file, double wait_seconds) {
  // O_NOFOLLOW: a symbolic link planted as the lock file is refused, not followed (the lock
  // file is never written, only locked, and it lives on between runs, so no O_EXCL).
  fd_ = ::open(lock_file.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    if (errno == ELOOP) {
      Fail(ErrorCode::kInvalidArgument,
           lock_file.string() + ": found a symbolic link, expected the lock file (a regular "
                                "file) or nothing; remove it");
    }
    FailErrno(lock_file.string(), "cannot create lock file", errno);
  }
  struct stat st;
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string type = FileTypeName(st.st_mode);
    ::close(fd_);
    fd_ = -1;
    Fail(ErrorCode::kInvalidArgument,
         lock_file.string() + ": found " + type + ", expected the lock file (a regular file)");
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(std::max(0.0, wait_seconds));
  while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK) {
      Fail(ErrorCode::kBusy, lock_file.parent_path().string() +
                                 ": another reshard process is writing this directory (lock " +
                                 lock_file.filename().string() + " is held); wait for it to finish");
    }
    FailErrno(lock_file.string(), "cannot lock", err);
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
}

std::optional<SharedClaim> SharedClaim::Take(const std::filesystem::path& claim_file,
                                             const std::string& owner,
                                             const std::string& description,
                                             std::string* held_owner, std::string* held_by) {
  // O_NOFOLLOW as for the lock file: a planted link is refused, never written through.
  int fd = ::open(claim_file.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == ELOOP) {
      Fail(ErrorCode::kInvalidArgument,
           claim_file.string() + ": found a symbolic link, expected reshard's claim file (a "
                                 "regular file) or nothing; remove it");
    }
    FailErrno(claim_file.string(), "cannot create the claim file", errno);
  }
  SharedClaim claim(fd);  // closes fd on every path out
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    Fail(ErrorCode::kInvalidArgument, claim_file.string() + ": found " + FileTypeName(st.st_mode) +
                                          ", expected reshard's claim file (a regular file)");
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
    // Nobody holds it: ours. Rewrite who holds it, then share it (under the directory lock,
    // so the moment between the two locks is never seen by another claimant).
    const std::string text = owner + "\n" + description + "\n";
    if (::ftruncate(fd, 0) != 0) FailErrno(claim_file.string(), "cannot write", errno);
    for (size_t done = 0; done < text.size();) {
      const ssize_t w = ::pwrite(fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) FailErrno(claim_file.string(), "cannot write", w < 0 ? errno : EIO);
      done += static_cast<size_t>(w);
    }
    if (::flock(fd, LOCK_SH | LOCK_NB) != 0) FailErrno(claim_file.string(), "cannot lock", errno);
    return claim;
  }
  if (errno != EWOULDBLOCK) FailErrno(claim_file.string(), "cannot lock", errno);
  // Held: by whom (at most 4 KiB are read; the writer writes two short lines).
  char buf[4096];
  const ssize_t n = ::pread(fd, buf, sizeof buf, 0);
  const std::string text(buf, n > 0 ? static_cast<size_t>(n) : 0);
  const size_t nl = text.find('\n');
  const std::string first = text.substr(0, nl);
  if (first == owner) {
    if (::flock(fd, LOCK_SH | LOCK_NB) == 0) return claim;
    if (errno != EWOULDBLOCK) FailErrno(claim_file.string(), "cannot lock", errno);
  }
  std::string second = nl == std::string::npos ? std::string() : text.substr(nl + 1);
  if (const size_t e = second.find('\n'); e != std::string::npos) second.resize(e);
  if (held_owner) *held_owner = Printable(first);
  if (held_by) *held_by = second.empty() ? "a process that did not say who it is" : Printable(second);
  return std::nullopt;
}

SharedClaim& SharedClaim::operator=(SharedClaim&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

SharedClaim::~SharedClaim() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

std::string SafeHostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "host";
  std::string h(buf);
  for (char& c : h) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_')) c = '_';
  }
  return h.empty() ? "host" : h;
}

std::string TempSuffix() { return ".tmp-" + SafeHostName() + "-" + std::to_string(::getpid()); }

bool OwnerIsDeadLocalProcess(std::string_view owner, bool bare_pid_is_local) {
  const auto dash = owner.rfind('-');
  if (dash == std::string_view::npos ? !bare_pid_is_local : owner.substr(0, dash) != SafeHostName()) {
    return false;
  }
  const std::string pid_text(dash == std::string_view::npos ? owner : owner.substr(dash + 1));
  char* end = nullptr;
  const long pid = std::strtol(pid_text.c_str(), &end, 10);
  if (!end || *end != '\0' || pid <= 0 || pid == ::getpid()) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM;
}

double PageCacheResidency(const std::string& path) {
  File f = File::OpenRead(path);
  const uint64_t size = f.Size();
  if (size == 0) return 1.0;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, f.fd(), 0);
  if (map == MAP_FAILED) return 0.0;
  const long page = ::sysconf(_SC_PAGESIZE);
  const size_t pages = (size + page - 1) / page;
  // Sample up to 64 pages spread over the file: enough to tell cold from warm (the loader
  // only asks "mostly cached?") without walking every page of a many-GB file. Each sample
  // is a system call: 4096 of them took 2-4 ms, 256 of them 0.3 ms, of a ~10 ms warm load
  // of a sub-GB file (bench/HISTORY.md §7).
  const size_t samples = std::min<size_t>(pages, 64);
  size_t resident = 0;
  unsigned char v = 0;
  for (size_t i = 0; i < samples; ++i) {
    const size_t page_index = i * pages / samples;
    if (::mincore(static_cast<char*>(map) + page_index * page, 1, &v) == 0) resident += v & 1;
  }
  const double fraction = static_cast<double>(resident) / static_cast<double>(samples);
  ::munmap(map, size);
  return fraction;
}

}  // namespace reshard
