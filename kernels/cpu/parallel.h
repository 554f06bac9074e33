// Splitting a kernel's jobs over OpenMP threads. Included inside a file's anonymous namespace, after <omp.h> where
// _OPENMP is defined.
#pragma once

// Runs body(first_job, end_job) over [0, jobs) on `threads` OpenMP threads, in contiguous ranges.
template <typename Body>
void parallel(int64_t jobs, int threads, Body body) {
    if (jobs <= 0) return;
    if (threads <= 1 || jobs < 2) {
        body(int64_t(0), jobs);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int64_t t = 0, n = 1;
#endif
        body(jobs * t / n, jobs * (t + 1) / n);
    }
}
