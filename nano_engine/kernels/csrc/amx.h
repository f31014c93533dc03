// What every AMX kernel needs before its first tile instruction: the OS's permission to use the
// tile registers (Linux hands them out on request, once per process) and a tile configuration
// (palette 1; each tile `rows` rows of 64 bytes: 16 x 32 bfloat16, or up to 16 x 16 float).
// Include only where __AMX_TILE__ is defined.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace tiles {

inline bool request() {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// rows[t]: the rows of tile t (1 to 16; 0 counts as 1).
inline void configure(const int (&rows)[8]) {
    struct alignas(64) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c;
    std::memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = rows[t] > 0 ? rows[t] : 1;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

}  // namespace tiles
