//! Dirty-page traces of running VMs (`tsubame trace`), the trace-driven
//! pseudo-migration of the SPP paper (`tsubame simulate`), and a planner
//! that fits the RDMA paper's dirty-page model (`tsubame plan`). Pure code:
//! no KVM, no network. The engine's auto-converge policy lives here too,
//! so that the real migration and the pseudo-migration share one copy.

pub mod auto_converge;
pub mod clock;
pub mod format;
pub mod plan;
mod replay;
pub mod simulate;

pub use format::{Interval, PageChange, Setup, Trace, TraceError, TraceWriter};
