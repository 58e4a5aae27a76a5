// A fresh directory per test case under the system's temporary folder, removed afterwards.
#pragma once

#include <unistd.h>  // for getpid

#include <filesystem>
#include <string>
#include <system_error>

struct TempDir {
    TempDir() {
        path = std::filesystem::temp_directory_path() /
               ("gradsync_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
        std::filesystem::remove_all(path);
        std::filesystem::create_directories(path);
    }
    ~TempDir() {
        std::error_code ignored;
        std::filesystem::remove_all(path, ignored);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    static int& counter() {
        static int n = 0;
        return n;
    }
    std::filesystem::path path;
};
