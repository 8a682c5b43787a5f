// The AMX tile configuration both tile kernels load (qgemm_amx.h, bf16_gemm.cpp), included inside a region
// compiled for amx-tile.
#pragma once

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12 does not see that the builtin reads all 64 bytes and dropped some of the stores that fill a
// configuration (the tile load then faulted): a compiler barrier makes them happen first.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
