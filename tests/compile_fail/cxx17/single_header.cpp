// A C++17 translation unit that includes the single header: one clear error, then the compiler stops.
#include <gradsync.hpp>

int main() { return 0; }
