// sdmha/io/detail/child_process.hpp — run_in_child: a function run in a forked child process
// under limits, its result returned as bytes over a pipe. For readers whose code is not ours
// (libhdf5): a crash, a hang or a runaway allocation in the child becomes a typed IoError in the
// caller, whose memory the child cannot touch.
//
//   math:  bytes = produce() in a child; Error subclasses thrown there are thrown again here
//   pre:   POSIX (fork, pipe, poll, waitpid, setrlimit); produce writes nothing to shared state
//   cost:  one fork (copy-on-write), the result copied through a pipe once
//
// The child inherits a copy of the caller's memory, but only the forking thread: a lock another
// thread held at the fork (HDF5's process-wide one, say) stays held in the child, which then
// waits until the time limit kills it. The child ends with _exit, so no atexit handler of the
// caller (HDF5's included) runs twice.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "sdmha/errors.hpp"
#include "sdmha/io/isolation.hpp"

namespace sdmha::detail {

// A sanitizer's runtime maps terabytes of address space for its shadow memory, which an
// address-space limit would refuse: those builds keep the time limit only.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kLimitAddressSpace = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
inline constexpr bool kLimitAddressSpace = false;
#else
inline constexpr bool kLimitAddressSpace = true;
#endif
#else
inline constexpr bool kLimitAddressSpace = true;
#endif

// The first byte of the child's message says what follows: the result, or an error of one kind
// (its message after it).
enum class ChildReply : char {
  result = 'R',
  shape = 'S',
  index = 'I',
  config = 'C',
  format = 'F',
  io = 'O',
  other = 'X'
};

inline ChildReply reply_kind(const std::exception& error) {
  if (dynamic_cast<const ShapeError*>(&error)) return ChildReply::shape;
  if (dynamic_cast<const IndexError*>(&error)) return ChildReply::index;
  if (dynamic_cast<const ConfigError*>(&error)) return ChildReply::config;
  if (dynamic_cast<const FormatError*>(&error)) return ChildReply::format;
  if (dynamic_cast<const IoError*>(&error)) return ChildReply::io;
  return ChildReply::other;
}

// Writes all of `bytes` to `fd` (a pipe end), retrying short writes and EINTR.
inline bool write_all(int fd, const std::string& bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t wrote = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) return false;
    done += std::size_t(wrote);
  }
  return true;
}

// The child's side: limits, produce(), the reply, _exit. Never returns.
template <typename Produce>
[[noreturn]] void child_main(int fd, const std::string& subject, const io::IsolationLimits& limits,
                             Produce& produce) {
  if (kLimitAddressSpace) {
    const rlimit memory{rlim_t(limits.memory_bytes), rlim_t(limits.memory_bytes)};
    ::setrlimit(RLIMIT_AS, &memory);
  }
  const rlimit no_core{0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  // What the child has to say comes back as its reply or its end; what a crashing library
  // prints on its way down (glibc's "malloc(): invalid size") would only break the caller's
  // one-line error messages.
  const int null = ::open("/dev/null", O_WRONLY);
  if (null >= 0) {
    ::dup2(null, STDERR_FILENO);
    ::close(null);
  }
  // A crash ends the child as a signal, which the caller reports; a handler the caller installed
  // (Python's faulthandler, a crash reporter) would run in the child and write to descriptors of
  // its own.
  for (const int fatal : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) ::signal(fatal, SIG_DFL);
  std::string reply;
  try {
    reply = char(ChildReply::result) + produce();
  } catch (const std::bad_alloc&) {
    reply = std::string(1, char(ChildReply::io)) + "sdmha: isolated reader: " + subject +
            ": out of memory under the child's limit of " + std::to_string(limits.memory_bytes) +
            " bytes";
  } catch (const std::exception& error) {
    reply = char(reply_kind(error)) + std::string(error.what());
  } catch (...) {
    reply = std::string(1, char(ChildReply::other)) + "an exception of unknown type";
  }
  ::_exit(write_all(fd, reply) ? 0 : 3);
}

// Reads the child's reply until end of file or the deadline; false when the deadline came first.
inline bool read_reply(int fd, std::chrono::steady_clock::time_point deadline, std::string& out) {
  char buffer[1 << 16];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd ready{fd, POLLIN, 0};
    const int polled = ::poll(&ready, 1, int(std::min<long long>(left.count(), 1 << 30)));
    if (polled < 0 && errno == EINTR) continue;
    if (polled <= 0) continue;  // the deadline is checked at the top
    const ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return true;  // end of file (or an error: the exit status tells)
    out.append(buffer, std::size_t(got));
  }
}

inline int wait_for(pid_t child) {
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// The caller's side of a finished child: its reply as the result, or its error thrown again
// with its type, or an IoError naming `subject` for a signal, a bad exit or no reply.
inline std::string take_reply(const char* where, const std::string& subject, int status,
                              const std::string& reply) {
  if (WIFSIGNALED(status))
    fail<IoError>(where, subject, ": the isolated reader was killed by signal ", WTERMSIG(status),
                  " (", ::strsignal(WTERMSIG(status)), "); the file is damaged or hostile");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || reply.empty())
    fail<IoError>(where, subject, ": the isolated reader ended without a reply (exit status ",
                  WIFEXITED(status) ? WEXITSTATUS(status) : -1, ")");
  const std::string message = reply.substr(1);
  switch (ChildReply(reply[0])) {
    case ChildReply::result:
      return message;
    case ChildReply::shape:
      throw ShapeError(message);
    case ChildReply::index:
      throw IndexError(message);
    case ChildReply::config:
      throw ConfigError(message);
    case ChildReply::format:
      throw FormatError(message);
    case ChildReply::io:
      throw IoError(message);
    default:
      throw Error(message);
  }
}

// produce() (returning std::string) in a forked child under `limits`; its result, or its error.
template <typename Produce>
std::string run_in_child(const char* where, const std::string& subject,
                         const io::IsolationLimits& limits, Produce produce) {
  if (!(limits.seconds > 0.0) || limits.memory_bytes == 0)
    fail<ConfigError>(where, "isolation limits are ", limits.seconds, " s and ",
                      limits.memory_bytes, " bytes; expected both > 0");
  int fds[2];
  if (::pipe(fds) != 0)
    fail<IoError>(where, subject, ": cannot create a pipe (", std::strerror(errno), ")");
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(limits.seconds));
  const pid_t child = ::fork();
  if (child < 0) {
    const int error = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    fail<IoError>(where, subject, ": cannot fork (", std::strerror(error), ")");
  }
  if (child == 0) {
    ::close(fds[0]);
    child_main(fds[1], subject, limits, produce);
  }
  ::close(fds[1]);
  std::string reply;
  const bool finished = read_reply(fds[0], deadline, reply);
  ::close(fds[0]);
  if (!finished) ::kill(child, SIGKILL);
  const int status = wait_for(child);
  if (!finished)
    fail<IoError>(where, subject, ": the isolated reader took longer than ", limits.seconds,
                  " s and was stopped; the file is damaged or hostile");
  return take_reply(where, subject, status, reply);
}

}  // namespace sdmha::detail
