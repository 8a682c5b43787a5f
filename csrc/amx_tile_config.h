// The AMX tile configuration the tile kernels load (qgemm_amx.h, bf16_gemm.cpp, attention_body.h's amx build),
// included inside a region compiled for amx-tile.
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

// Every tile 16 rows of 64 bytes (the bf16 GEMM's and the attention's AMX scores' shape).
inline void configure_full_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}
