//! The integration tests of `hierarchical-throttle` (in `../tests`) and its examples beyond
//! axum (in `../examples`), built with the dependencies only they need.
//!
//! Run the tests with `cargo test -p hierarchical-throttle-suite`, an example with
//! `cargo run -p hierarchical-throttle-suite --example tonic`.
