//! tsubame's migration engine: pre-copy source and destination state
//! machines, the stream format, transports, digests and statistics.

pub mod buffer_budget;
pub mod destination;
pub mod digest;
pub mod options;
pub mod pages;
pub mod pipeline;
pub mod recorder;
pub mod replay;
pub mod secure;
pub mod source;
pub mod source_vm;
pub mod stats;
pub mod subpage;
pub mod transport;
pub mod wire;
pub mod zerocopy;

pub use options::{GpuOffload, MigrateOptions, Progress, ProgressCell};
pub use stats::MigrationStats;
pub use transport::Address;
