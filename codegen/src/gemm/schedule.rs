//! Placeholder, replaced by the schedule work.
