// A C++17 translation unit that includes gradsync: one clear error, then the compiler stops.
#include <gradsync/gradsync.hpp>

int main() { return 0; }
