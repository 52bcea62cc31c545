//! host (todo)
