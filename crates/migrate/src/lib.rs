//! Migration engine.
