//! Facts about the host process that the engine measures itself with.

/// CPU-seconds (user + system) of this process or thread so far.
fn cpu_seconds(who: libc::c_int) -> f64 {
    // SAFETY: getrusage only writes the struct it is given, which is a
    // plain-old-data value for which all-zero bytes are valid.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// This process's CPU-seconds, all threads (vCPUs included).
pub fn process_cpu_seconds() -> f64 {
    cpu_seconds(libc::RUSAGE_SELF)
}

/// The calling thread's CPU-seconds.
pub fn thread_cpu_seconds() -> f64 {
    cpu_seconds(libc::RUSAGE_THREAD)
}
