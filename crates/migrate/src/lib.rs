//! tsubame's migration engine. docs/architecture.md is the map: the
//! protocol both ends speak ([`protocol`]), the sending side
//! ([`source`]), the receiving side ([`destination`]), and what they share
//! (transports, digests, sub-page tracking, statistics).

pub mod buffer_budget;
pub mod destination;
pub mod digest;
pub mod options;
pub mod protocol;
pub mod recorder;
pub mod replay;
pub mod secure;
pub mod source;
pub mod stats;
pub mod subpage;
pub mod transport;

pub use options::{GpuOffload, MigrateOptions, PostcopyMode, Progress, ProgressCell};
pub use stats::MigrationStats;
pub use transport::Address;
