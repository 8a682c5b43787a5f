// How the CPU attention shares its units out among threads: runs of consecutive units of about equal cost.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace specjet_cpu {

// The first unit of each of `shares` runs of consecutive units, then the unit count: run s is
// [starts[s], starts[s + 1]). `cost_end[i]` is the cost of units 0 .. i together (non-decreasing). Run s starts
// at the unit boundary nearest to s / shares of the total cost. (A boundary that merely lay past that point
// left a run short by up to a whole unit: with 3 KV heads in two key chunks on 2 threads, one thread took 2
// units and the other 4.)
inline std::vector<int64_t> cost_share_starts(const std::vector<double>& cost_end, int64_t shares) {
  if (shares < 1) throw std::invalid_argument("cost_share_starts: shares must be at least 1");
  for (size_t i = 0; i < cost_end.size(); ++i)
    if (!std::isfinite(cost_end[i]) || cost_end[i] < 0.0 || (i > 0 && cost_end[i] < cost_end[i - 1]))
      throw std::invalid_argument("cost_share_starts: cost_end must be finite, non-negative and non-decreasing");
  const int64_t n = static_cast<int64_t>(cost_end.size());
  const double total = n ? cost_end.back() : 0.0;
  std::vector<int64_t> starts(shares + 1, n);
  starts[0] = 0;
  for (int64_t s = 1; s < shares; ++s) {
    const double bound = total * static_cast<double>(s) / static_cast<double>(shares);
    // Boundary i (before unit i) has cost_end[i - 1] before it: the first boundary past the bound, or the one
    // before it where that is nearer.
    const int64_t i = std::lower_bound(cost_end.begin(), cost_end.end(), bound) - cost_end.begin();
    if (i >= n) break;
    const double before = i > 0 ? cost_end[i - 1] : 0.0;
    starts[s] = std::max(starts[s - 1], bound - before <= cost_end[i] - bound ? i : i + 1);
  }
  return starts;
}

}  // namespace specjet_cpu
