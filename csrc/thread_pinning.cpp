// Binding the calling thread's OpenMP team to CPUs, one thread a CPU (what OMP_PROC_BIND=true does for a
// process that sets it before its OpenMP runtime starts, which a library cannot count on). Unbound, a team
// whose workers slept through an idle spell is woken onto whatever CPU the kernel picks, often the one
// its master runs on: the two then share a core for milliseconds, and every barrier of the next forward
// waits for the thread that is not running (bench/RESULTS.md, session 54).
#include <pthread.h>
#include <sched.h>

#include <ATen/Parallel.h>
#include <omp.h>

#include "cpu_ops.h"

namespace specjet_cpu {

std::vector<int64_t> pin_team_threads(const std::vector<int64_t>& cpus) {
  TORCH_CHECK(!cpus.empty(), "pin_team_threads: no CPUs given");
  for (const int64_t cpu : cpus) TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "pin_team_threads: bad CPU ", cpu);
  const int team = at::get_num_threads();
  std::vector<int64_t> placed(team, -1);
  const int64_t n = static_cast<int64_t>(cpus.size());
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num();
    const int64_t cpu = cpus[t % n];
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpu), &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0) placed[t] = cpu;
  }
  return placed;
}

}  // namespace specjet_cpu
