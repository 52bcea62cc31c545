//! Placeholder, replaced by the reference work.
