//! Limits and quotas loaded with serde: the TOML example file, and errors that name the part.

use std::collections::HashMap;

use hierarchical_throttle::{Limit, Quota};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct Settings {
    default_tier: String,
    tiers: HashMap<String, Quota>,
    levels: HashMap<String, Quota>,
}

#[test]
fn the_example_file_loads_tiers_and_levels() {
    let settings: Settings = toml::from_str(include_str!("../examples/tiers.toml")).unwrap();
    assert_eq!(settings.default_tier, "free");
    let free = &settings.tiers["free"];
    assert_eq!(
        free.get("per-minute"),
        Some(&Limit::per_minute(60).burst(10).unwrap())
    );
    // Printed in the unit it was written in; it reads back as the same quota.
    assert_eq!(free.to_string(), "per-minute: 60/min burst 10");
    assert_eq!(
        free.to_string()
            .parse::<hierarchical_throttle::Quota>()
            .unwrap(),
        *free
    );
    let pro = &settings.tiers["pro"];
    assert_eq!(
        pro.get("per-second"),
        Some(&Limit::per_second(100).burst(200).unwrap())
    );
    assert_eq!(
        pro.get("per-day"),
        Some(&Limit::per_day(100_000).build().unwrap())
    );
    assert_eq!(settings.levels["route"].to_string(), "default: 1/s burst 5");
    assert_eq!(settings.levels["tenant"].len(), 1);
}

#[derive(Debug, Deserialize, serde::Serialize, PartialEq)]
struct OneLimit {
    limit: Limit,
}

#[test]
fn limits_round_trip_and_bad_ones_name_the_part() {
    let read: OneLimit = toml::from_str("limit = \"15 per 2min\"").unwrap();
    assert_eq!(
        read.limit,
        Limit::per(15, std::time::Duration::from_secs(120))
            .build()
            .unwrap()
    );
    let written = toml::to_string(&read).unwrap();
    assert_eq!(toml::from_str::<OneLimit>(&written).unwrap(), read);

    let error = toml::from_str::<OneLimit>("limit = \"100/fortnight\"").unwrap_err();
    assert!(error.to_string().contains("`fortnight`"), "{error}");
    let error = toml::from_str::<Settings>(
        "default_tier = \"x\"\n[tiers]\nx = { \"bad name\" = \"1/s\" }\n[levels]\n",
    )
    .unwrap_err();
    assert!(error.to_string().contains("`bad name`"), "{error}");
}

#[test]
fn a_warm_up_loads_and_prints_back() {
    let read: OneLimit = toml::from_str("limit = \"2/s burst 1 warm-up 4s\"").unwrap();
    assert_eq!(
        read.limit.warm_up_period(),
        Some(std::time::Duration::from_secs(4))
    );
    let written = toml::to_string(&read).unwrap();
    assert_eq!(written.trim(), "limit = \"2/s burst 1 warm-up 4s\"");
    let quota: Quota = "per-second: 100/s warm-up 30s; per-day: 100,000/day"
        .parse()
        .unwrap();
    assert_eq!(
        quota.get("per-second").and_then(Limit::warm_up_period),
        Some(std::time::Duration::from_secs(30))
    );
    assert_eq!(quota.get("per-day").and_then(Limit::warm_up_period), None);
    assert_eq!(quota.to_string().parse::<Quota>().unwrap(), quota);
    let error = toml::from_str::<OneLimit>("limit = \"2/s warm-up 0s\"").unwrap_err();
    assert!(error.to_string().contains("0s"), "{error}");
}
