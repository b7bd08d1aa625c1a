// tests/lint/function_length_cases.hpp — the self-test of function_length.py (never compiled):
// every function body's opening line carries `expect N`, its length in lines; the script must
// find exactly these, with these lengths, and nothing else.
#pragma once
#define SOME_MACRO(x) \
  do { if (x) { } } while (0)
#include <vector>

namespace outer {
namespace inner {

int table[] = {1, 2, 3};  // an initializer, not a function
const char* text = "} { not a brace";
constexpr long big = 1'000'000;
enum class Colour { red, green };

inline int plain(int a) {  // expect 4
  const char open = '{';
  return a + open;
}

inline int with_default(const std::vector<int>& v = {}, int w = int{2}) {  // expect 5
  /* a comment with } and {
     over two lines */
  return int(v.size()) + w;
}

auto lambda_at_namespace_scope = [](int x) {  // expect 3
  return x + 1;
};

template <typename T, typename = void>
struct Detect : std::false_type {};
template <typename T>
struct Detect<T, std::void_t<decltype(T::value(std::declval<int>()))>> : std::true_type {
  static int helper() { return 1; }  // expect 1
};

class Widget {
 public:
  Widget(int a, int b) : a_{a}, b_{b, a}, c_(std::vector<int>{1, 2}) {  // expect 4
    const char close = '}';
    (void)close;
  }
  ~Widget() {}  // expect 1
  template <typename F>
  void each(F&& f) const {  // expect 7
    for (int i = 0; i < a_; ++i) {
      auto call = [&](int k) { f(k); };
      call(i);
    }
    const char* raw = R"x(} { )" )x";
  }

 private:
  int a_{3};
  std::vector<int> b_{1, 2};
  std::vector<int> c_;
  struct Nested {
    int value() const noexcept {  // expect 3
      return 4;
    }
  };
};

template <typename T>
struct Kernel {
  void operator()(const T& t) const;
};

template <typename T>
void Kernel<T>::operator()(const T& t) const {  // expect 6
  if (t) {
    // }
  }
  (void)t;
}

extern "C" {
int c_function(void) { return 0; }  // expect 1
}

}  // namespace inner
}  // namespace outer
