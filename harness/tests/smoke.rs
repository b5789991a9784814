use powerflex_site_harness::{JobSpec, Site, SiteOptions};

#[test]
fn smoke() {
    let mut site = Site::new(SiteOptions::new(7, 3000.0)).expect("site");
    site.submit(JobSpec::training(
        "1",
        "flex3,calibrate=off",
        0,
        4,
        "qwen3-30b-a3b-moe-ft-8g",
    ))
    .expect("job");
    site.submit(JobSpec::training(
        "2",
        "flex3,calibrate=off",
        1,
        4,
        "qwen3-30b-a3b-moe-ft-8g",
    ))
    .expect("job");
    for _ in 0..10 {
        site.run_for(1000);
        println!(
            "t={} draw={:.0} budget={:.0} caps={:?} allocs={}",
            (site.now_ms() - powerflex_site_harness::site::T0_MS) / 1000,
            site.draw_w(),
            site.budget_in_force_w(site.now_ms()),
            site.caps_w(),
            site.allocations()
        );
    }
    let over = site
        .samples()
        .iter()
        .filter(|s| s.draw_w > s.budget_w)
        .count();
    println!("over {over} of {}", site.samples().len());
}
