//! Facts about the host process that the engine measures itself with,
//! and the share of the CPU its threads ask for.

/// This process's CPU-seconds (user + system), all threads (vCPUs
/// included).
pub fn process_cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct it is given, which is a
    // plain-old-data value for which all-zero bytes are valid.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// The calling thread's CPU-seconds.
pub fn thread_cpu_seconds() -> f64 {
    thread_cpu_time().as_secs_f64()
}

/// Seconds on the host's monotonic clock (CLOCK_MONOTONIC, which
/// `Instant` reads too): a moment other tools on this host can line up
/// with, e.g. `perf record -k mono`.
pub fn monotonic_seconds() -> f64 {
    let now = clock(libc::CLOCK_MONOTONIC);
    now.tv_sec as f64 + now.tv_nsec as f64 / 1e9
}

/// Clock `id` now.
fn clock(id: libc::clockid_t) -> libc::timespec {
    // SAFETY: clock_gettime only writes the timespec it is given, a
    // plain-old-data value for which all-zero bytes are valid.
    unsafe {
        let mut now: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(id, &mut now);
        now
    }
}

/// The calling thread's CPU time so far, to the nanosecond: what a piece
/// of work cost, not counting the time the thread waited for a CPU (on a
/// host whose cores the guest shares, a wall clock around the same work
/// read up to twice as much, and more in some half hours than others).
pub fn thread_cpu_time() -> std::time::Duration {
    let now = clock(libc::CLOCK_THREAD_CPUTIME_ID);
    std::time::Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// Asks the scheduler to let every normal thread go first whenever the
/// calling thread competes with one (nice 10) until the guard drops: for
/// bulk work, such as post-copy's background push, that must not delay a
/// fault's service on a host with few cores. Best effort: a refusal
/// leaves the thread as it was.
pub fn lower_thread_priority() -> LoweredPriority {
    let tid = thread_id();
    // SAFETY: getpriority takes and returns plain integers; the target is
    // this thread. (-1 is also a valid nice value: errno is not checked,
    // the restore is best effort too.)
    let before = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
    lower_priority_of(tid as libc::pid_t);
    LoweredPriority { before, _this_thread: std::marker::PhantomData }
}

/// Restores the thread's priority when dropped (on the thread that made it).
pub struct LoweredPriority {
    before: libc::c_int,
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl Drop for LoweredPriority {
    fn drop(&mut self) {
        // SAFETY: as in lower_priority_of (this thread).
        unsafe { libc::setpriority(libc::PRIO_PROCESS, thread_id(), self.before) };
    }
}

fn thread_id() -> libc::id_t {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as libc::id_t }
}

/// Runs the calling thread first whenever it is ready to run (SCHED_FIFO,
/// the lowest real-time priority) until the guard drops: for the few
/// milliseconds of a migration's switch, whose threads otherwise wait for
/// a CPU behind a running guest (on a host with few cores a wake-up took
/// 2-3 ms of a switch that needs 0.5). Such a thread must block, never
/// spin, and threads it starts inherit the policy. Best effort: without
/// CAP_SYS_NICE nothing changes.
pub fn realtime_thread() -> Realtime {
    let tid = thread_id() as libc::pid_t;
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler reads the param struct, which lives
    // across the call; the target is this thread.
    let set = unsafe { libc::sched_setscheduler(tid, libc::SCHED_FIFO, &param) } == 0;
    Realtime { set, _this_thread: std::marker::PhantomData }
}

/// Keeps the host's idle CPUs polling instead of halting until dropped
/// (PM QoS: 0 µs written to /dev/cpu_dma_latency): for the few
/// milliseconds of a stop, whose threads hand work to each other across
/// CPUs. A thread woken on a CPU that had halted waited up to 2-3 ms on
/// this host (a guest's halt exits to its hypervisor). Idle CPUs spin
/// meanwhile. Best effort: without the device or the right to write it
/// nothing changes.
pub fn quick_wakeups() -> QuickWakeups {
    use std::io::Write;
    let held = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/cpu_dma_latency")
        .and_then(|mut qos| qos.write_all(&0i32.to_ne_bytes()).map(|()| qos))
        .ok();
    QuickWakeups { _held: held }
}

/// The request of [`quick_wakeups`], withdrawn when dropped (the kernel
/// drops it as the file closes).
pub struct QuickWakeups {
    _held: Option<std::fs::File>,
}

/// Puts the thread back under the normal scheduler when dropped.
pub struct Realtime {
    set: bool,
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl Drop for Realtime {
    fn drop(&mut self) {
        if self.set {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: as in realtime_thread.
            unsafe { libc::sched_setscheduler(thread_id() as libc::pid_t, libc::SCHED_OTHER, &param) };
        }
    }
}

/// Makes thread `tid` of this process run first whenever it is ready
/// (SCHED_FIFO, lowest priority): for a vCPU thread about to be stopped,
/// which must get a CPU at once to notice (it puts itself back with
/// [`normal_thread`] as it stops). Best effort, as [`realtime_thread`].
pub fn hurry_thread(tid: libc::pid_t) {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: as in realtime_thread; `tid` names a thread of this process.
    unsafe { libc::sched_setscheduler(tid, libc::SCHED_FIFO, &param) };
}

/// Puts thread `tid` of this process back under the normal scheduler
/// (undoes [`hurry_thread`]).
pub fn normal_thread_of(tid: libc::pid_t) {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: as in realtime_thread; `tid` names a thread of this process.
    unsafe { libc::sched_setscheduler(tid, libc::SCHED_OTHER, &param) };
}

/// Lets every normal thread go first whenever thread `tid` of this
/// process competes with one (nice 10), for good: as
/// [`lower_thread_priority`], for a thread busy with long work that cannot
/// look at a request to lower itself. Threads it starts later inherit it.
pub fn lower_priority_of(tid: libc::pid_t) {
    // SAFETY: setpriority takes plain integers; `tid` names a thread of
    // this process.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10) };
}

/// This thread's kernel id.
pub fn current_thread_id() -> libc::pid_t {
    thread_id() as libc::pid_t
}

/// Puts the calling thread under the normal scheduler, whatever its
/// creator's policy: a vCPU thread runs guest code for as long as it may,
/// and must never do so ahead of every other thread.
pub fn normal_thread() {
    normal_thread_of(thread_id() as libc::pid_t);
}

/// The CPUs the calling thread may run on (empty where the kernel does
/// not say).
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain-old-data (all-zero bytes: the empty
    // set); sched_getaffinity writes at most its size into it.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        set
    };
    // SAFETY: CPU_ISSET reads the set it is given, within its size.
    (0..libc::CPU_SETSIZE as usize).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) }).collect()
}

/// The CPU the calling thread runs on now.
pub fn current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu has no preconditions.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).ok()
}

/// The calling thread's CPU and the others it may use: for keeping a
/// stop's threads apart.
pub struct CpuSplit {
    /// Every CPU the thread may use.
    pub all: Vec<usize>,
    /// The one it runs on now.
    pub here: usize,
    /// The rest, never empty.
    pub others: Vec<usize>,
}

impl CpuSplit {
    /// None where the kernel does not say, or with one CPU only.
    pub fn here() -> Option<CpuSplit> {
        let all = allowed_cpus();
        let here = current_cpu()?;
        let others: Vec<usize> = all.iter().copied().filter(|&cpu| cpu != here).collect();
        (!others.is_empty()).then_some(CpuSplit { all, here, others })
    }
}

/// Lets `thread` (a thread of this process) run only on `cpus`: for the
/// stop, where two threads handing work to each other were both left on
/// one CPU while the other idled. Best effort: a refusal (or no CPU
/// named) leaves the thread as it was.
pub fn set_thread_cpus(thread: libc::pthread_t, cpus: &[usize]) {
    if cpus.is_empty() {
        return;
    }
    // SAFETY: as in allowed_cpus; CPU_SET writes within the set, and
    // pthread_setaffinity_np reads it; `thread` is a live thread of this
    // process (its handle is held by the caller).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus.iter().filter(|&&cpu| cpu < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::pthread_setaffinity_np(thread, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The calling thread's pthread handle.
pub fn this_pthread() -> libc::pthread_t {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() }
}
