"""Builds az_chat.jsonl and az_chat_val.jsonl: the demo Azerbaijani chat set, written for minilm-az.

Deterministic (seeded); run `python data/chat/build.py` from the repo root to regenerate.
Hand-written question/answer pairs and dialogues over everyday topics, plus a few templated
families (capitals, arithmetic, word translation) for volume, with system prompts on some.
"""

import json
import os
import random

SYSTEMS = [
    "Sən köməkçi süni intellekt assistentisən. Azərbaycan dilində qısa və dəqiq cavab ver.",
    "Sən mehriban bir assistentsən. İstifadəçiyə sadə dillə izah et.",
    "Cavablarını həmişə Azərbaycan dilində, nəzakətlə və aydın yaz.",
    "Qısa cavab ver: bir-iki cümlədən artıq yazma.",
]
TEACHER = "Sən məktəblilərə kömək edən müəllimsən. Mövzunu sadə və aydın izah et."

QA = [
    ("Salam! Necəsən?", "Salam! Yaxşıyam, soruşduğun üçün sağ ol. Sənə necə kömək edə bilərəm?"),
    ("Sabahın xeyir!", "Sabahın xeyir! Gününün uğurlu keçməsini arzulayıram. Nə ilə kömək edim?"),
    (
        "Sən kimsən?",
        "Mən Azərbaycan dilində danışan kiçik bir dil modeliyəm. Suallarına cavab verməyə "
        "və mətn yazmağa kömək edə bilərəm.",
    ),
    (
        "Plov necə bişirilir?",
        "Plov üçün əvvəlcə düyünü yuyub duzlu suda isladırsan. Sonra düyünü yarımçıq "
        "qaynadıb süzürsən, qazanın dibinə qazmaq qoyub düyünü üstünə yığırsan və zəif odda dəmə qoyursan. "
        "Ayrıca ət, soğan, şabalıd və quru meyvədən ibarət qara hazırlanır.",
    ),
    (
        "Dolma üçün hansı ərzaqlar lazımdır?",
        "Yarpaq dolması üçün üzüm yarpağı, qiymə, düyü, soğan, göyərti "
        "(şüyüd, keşniş, nanə), duz və istiot lazımdır. Üstünə sarımsaqlı qatıq ilə verilir.",
    ),
    (
        "Qutabın neçə növü var?",
        "Ən məşhur növləri göy qutabı, ət qutabı və balqabaq qutabıdır. Bəzi "
        "bölgələrdə dəvə əti və ya pendirlə də bişirilir.",
    ),
    (
        "Novruz bayramı nə vaxt qeyd olunur?",
        "Novruz bayramı hər il martın 20-si və ya 21-i, yaz "
        "gecə-gündüz bərabərliyi günü qeyd olunur. Bayramdan əvvəl dörd çərşənbə axşamı keçirilir: su, od, "
        "yel və torpaq çərşənbələri.",
    ),
    (
        "Novruzda hansı şirniyyatlar bişirilir?",
        "Novruzda şəkərbura, paxlava və qoğal bişirilir. Süfrəyə səməni, boyanmış yumurta və qoz-fındıq da qoyulur.",
    ),
    (
        "Nizami Gəncəvi kimdir?",
        "Nizami Gəncəvi XII əsrdə Gəncədə yaşamış böyük Azərbaycan şairidir. "
        "Onun «Xəmsə» adlanan beş poemadan ibarət əsəri dünya ədəbiyyatının incilərindəndir.",
    ),
    (
        "Muğam nədir?",
        "Muğam Azərbaycanın klassik musiqi janrıdır. O, tar, kamança və qaval kimi alətlərin "
        "müşayiəti ilə ifa olunur və 2003-cü ildə UNESCO tərəfindən bəşəriyyətin qeyri-maddi irsi elan "
        "edilib.",
    ),
    (
        "Bakının ən məşhur tarixi yeri hansıdır?",
        "Bakının ən məşhur tarixi yeri İçərişəhərdir. Orada Qız qalası və Şirvanşahlar sarayı yerləşir.",
    ),
    (
        "Şəkiyə nə vaxt getmək yaxşıdır?",
        "Şəkiyə yazın sonunda və ya payızın əvvəlində getmək yaxşıdır. Hava "
        "mülayim olur, meşələr gözəl görünür. Şəki xan sarayını və karvansaranı mütləq ziyarət et.",
    ),
    (
        "Qəbələdə nə görmək olar?",
        "Qəbələdə Nohur gölünü, Yeddi gözəl şəlaləsini görə və kanat yolu ilə "
        "Tufandağa qalxa bilərsən. Qədim Qəbələ şəhərinin xarabalıqları da maraqlıdır.",
    ),
    (
        "Qubanın nəyi məşhurdur?",
        "Quba alma bağları, xalçaları və Qırmızı Qəsəbəsi ilə məşhurdur. Yayda "
        "Qəçrəş meşələri və Təngəaltı dərəsi də çox gözəl olur.",
    ),
    (
        "Xəzər dənizi haqqında nə bilirsən?",
        "Xəzər dünyanın ən böyük qapalı su hövzəsidir. Onun sahilində "
        "Azərbaycan, Rusiya, Qazaxıstan, Türkmənistan və İran yerləşir. Dənizdə neft və qaz yataqları var.",
    ),
    (
        "Kompüterim çox yavaş işləyir. Nə edim?",
        "Əvvəlcə lazımsız proqramları bağla və avtomatik açılan "
        "proqramların sayını azalt. Diskdə boş yer olduğunu yoxla, sistemi yenilə və antivirusla skan et. "
        "Kömək etməsə, operativ yaddaşı artırmağı düşünə bilərsən.",
    ),
    (
        "Telefonumun batareyası tez bitir.",
        "Ekranın parlaqlığını azalt, istifadə etmədiyin Bluetooth və GPS "
        "funksiyalarını söndür. Arxa fonda işləyən tətbiqləri bağla. Batareya köhnədirsə, onu dəyişmək "
        "lazım ola bilər.",
    ),
    (
        "Güclü parol necə olmalıdır?",
        "Güclü parol ən azı on iki simvoldan ibarət olmalı, böyük və kiçik "
        "hərflər, rəqəmlər və işarələr daşımalıdır. Hər sayt üçün ayrı parol istifadə et və parolları "
        "heç kimlə bölüşmə.",
    ),
    (
        "Yaxşı yatmaq üçün nə məsləhət görərsən?",
        "Hər gün eyni saatda yatıb oyanmağa çalış. Yatmazdan bir saat "
        "əvvəl telefondan uzaq dur, axşam çay və qəhvəni azalt. Otaq sərin, qaranlıq və sakit olsun.",
    ),
    (
        "Gündə nə qədər su içmək lazımdır?",
        "Adətən yaşlı adam üçün gündə təxminən iki litr su məsləhət "
        "görülür. İsti havada və idmandan sonra daha çox içmək lazımdır.",
    ),
    (
        "İmtahana necə hazırlaşım?",
        "Mövzuları kiçik hissələrə böl və hər gün bir az oxu. Oxuduqlarını öz "
        "sözlərinlə qısa yaz, keçmiş illərin suallarını həll et. İmtahandan əvvəlki gecə yaxşı yat.",
    ),
    (
        "İngilis dilini necə tez öyrənmək olar?",
        "Hər gün azı yarım saat məşq et: yeni sözlər öyrən, ingiliscə "
        "filmlərə altyazı ilə bax və sadə kitablar oxu. Ən vacibi danışmaqdan çəkinməməkdir.",
    ),
    (
        "Fotosintez nədir?",
        "Fotosintez bitkilərin günəş işığının enerjisi ilə karbon qazı və sudan qlükoza "
        "və oksigen hasil etməsidir. Bu proses yarpaqlardakı xlorofildə baş verir.",
    ),
    (
        "Niyə göy mavi görünür?",
        "Günəş işığı atmosferdən keçəndə qısa dalğalı mavi işıq hava molekulları "
        "tərəfindən daha çox səpələnir. Buna görə də göy üzü bizə mavi görünür.",
    ),
    (
        "Yer Günəşin ətrafında nə qədər vaxta fırlanır?",
        "Yer Günəşin ətrafında təxminən 365 gün 6 saata "
        "bir dövr edir. Buna görə də hər dörd ildən bir fevral ayı 29 gün olur.",
    ),
    (
        "Su neçə dərəcədə qaynayır?",
        "Dəniz səviyyəsində təmiz su 100 dərəcə Selsidə qaynayır. Dağlarda "
        "hava təzyiqi aşağı olduğu üçün su daha tez, aşağı temperaturda qaynayır.",
    ),
    (
        "Bir atalar sözü de.",
        "«Səbr acıdır, meyvəsi şirin.» Bu atalar sözü səbrin çətin olduğunu, amma "
        "sonunda yaxşı nəticə verdiyini deyir.",
    ),
    (
        "«Ağac bar verdikcə başını aşağı salar» nə deməkdir?",
        "Bu atalar sözü deyir ki, bilikli və dəyərli insan təvazökar olur, özünü göstərmir.",
    ),
    (
        "Dostuma ad günü təbriki yaz.",
        "Əziz dostum, ad günün mübarək! Sənə can sağlığı, xoşbəxtlik və bütün "
        "arzularının həyata keçməsini diləyirəm. Yaxşı ki varsan!",
    ),
    (
        "Müəllimimə təşəkkür məktubu yazmağa kömək et.",
        "Hörmətli müəllimim! Bizə verdiyiniz bilik və "
        "göstərdiyiniz səbr üçün ürəkdən təşəkkür edirəm. Sizin dərsləriniz məni daha çox oxumağa "
        "həvəsləndirdi. Hörmətlə, şagirdiniz.",
    ),
    (
        "İşə gecikəcəyimi rəhbərimə necə bildirim?",
        "Qısa və nəzakətli yaz: «Hörmətli Rəşad müəllim, yolda "
        "tıxac olduğu üçün təxminən iyirmi dəqiqə gecikəcəyəm. Anlayışınız üçün təşəkkür edirəm.»",
    ),
    (
        "Payız haqqında qısa şeir yaz.",
        "Yarpaqlar saralır, küləklər əsir,\nBuludlar göy üzünü örtür.\n"
        "Payız gəldi yenə, yağış yağır,\nBağlarda nar, heyva yetişir.",
    ),
    (
        "Bir tapmaca de.",
        "Tapmaca: «Dili var, danışmaz, ayağı var, yeriməz.» Cavabı: ayaqqabı. İstəsən, başqa tapmaca da deyə bilərəm.",
    ),
    (
        "Python nədir?",
        "Python sadə sintaksisi olan məşhur proqramlaşdırma dilidir. Onunla veb saytlar, "
        "məlumat təhlili və süni intellekt proqramları yazırlar.",
    ),
    (
        "Süni intellekt nədir?",
        "Süni intellekt kompüterlərin öyrənmə, nəticə çıxarma və dil anlama kimi "
        "insana xas işləri görməsini təmin edən elm sahəsidir.",
    ),
    (
        "Dil modeli necə öyrənir?",
        "Dil modeli böyük həcmdə mətn oxuyur və hər dəfə növbəti sözü təxmin "
        "etməyə çalışır. Səhv etdikcə parametrlərini düzəldir və tədricən dilin qaydalarını mənimsəyir.",
    ),
    (
        "Azərbaycan əlifbasında neçə hərf var?",
        "Müasir Azərbaycan latın əlifbasında 32 hərf var. Onların "
        "arasında ə, ğ, ı, ö, ü, ç və ş kimi xüsusi hərflər də var.",
    ),
    (
        "«Kitab» sözünün cəmi necədir?",
        "«Kitab» sözünün cəmi «kitablar»dır. Ahəng qanununa görə son hecada "
        "qalın sait olduğu üçün «-lar» şəkilçisi artırılır.",
    ),
    (
        "«Ev» sözünə cəm şəkilçisi necə artırılır?",
        "«Ev» sözünün son saiti incə olduğu üçün «-lər» şəkilçisi artırılır: «evlər».",
    ),
    (
        "Bu cümləni düzəlt: «Mən dünən məktəbə gedirəm.»",
        "Düzgün variant: «Mən dünən məktəbə getdim.» "
        "«Dünən» keçmiş zamanı göstərdiyi üçün fel də keçmiş zamanda olmalıdır.",
    ),
    (
        "Sağlam səhər yeməyi nə ola bilər?",
        "Yulaf sıyığı, pendir, göyərti, qaynadılmış yumurta və bir "
        "meyvə yaxşı seçimdir. Şəkərli içkilər əvəzinə su və ya şəkərsiz çay iç.",
    ),
    (
        "Evdə hansı idman hərəkətlərini etmək olar?",
        "Çöməlmə, şınaq, planka və yerində qaçış evdə etmək "
        "üçün asan hərəkətlərdir. Gündə iyirmi dəqiqə məşq etmək də fayda verir.",
    ),
    (
        "Pulumu necə qənaət edim?",
        "Aylıq gəlir və xərclərini yaz, hər ay gəlirinin bir hissəsini əvvəlcədən "
        "ayır. Lazımsız alış-verişdən qaç və böyük alışlardan əvvəl qiymətləri müqayisə et.",
    ),
    (
        "Çay necə dəmlənir?",
        "Çaydanı qaynar su ilə isit, içinə qara çay tök və üstünə qaynar su əlavə et. "
        "Beş-yeddi dəqiqə zəif odun üstündə və ya isti yerdə dəmə qoy. Armudu stəkanda, limon və ya mürəbbə "
        "ilə süfrəyə ver.",
    ),
    (
        "Bakıda metro neçə xəttdən ibarətdir?",
        "Bakı metrosunun hazırda üç xətti var: qırmızı, yaşıl və "
        "bənövşəyi xətlər. Metro 1967-ci ildən fəaliyyət göstərir.",
    ),
    (
        "Ən uzun çay hansıdır?",
        "Dünyanın ən uzun çayları Nil və Amazondur; hansının daha uzun olduğu "
        "ölçmə üsulundan asılıdır. Azərbaycanın ən uzun çayı isə Kürdür.",
    ),
    (
        "Kür çayı haradan başlayır?",
        "Kür çayı Türkiyə ərazisindən başlayır, Gürcüstandan keçərək Azərbaycana daxil olur və Xəzər dənizinə tökülür.",
    ),
    (
        "Stressi necə azaltmaq olar?",
        "Dərin nəfəs al, təmiz havada gəzintiyə çıx və sevdiyin işlə məşğul "
        "ol. Yaxın adamlarla danışmaq da kömək edir. Uzun sürən stress olarsa, mütəxəssisə müraciət et.",
    ),
    (
        "Uşaqlara kitab oxumağı necə sevdirim?",
        "Hər axşam birlikdə kitab oxuyun, uşağın maraqlandığı "
        "mövzuları seçin. Evdə kiçik kitab rəfi düzəldin və özünüz də oxuyan nümunə olun.",
    ),
    (
        "Qış üçün hansı meyvələr faydalıdır?",
        "Qışda nar, heyva, portağal və limon faydalıdır, çünki onlarda "
        "çoxlu C vitamini var. Quru meyvə və qoz da enerji verir.",
    ),
    ("Bir sözlə cavab ver: Azərbaycanın paytaxtı?", "Bakı."),
    (
        "Ayda neçə gün var?",
        "Ayların çoxu 30 və ya 31 gündən ibarətdir. Fevral adi illərdə 28, uzun illərdə isə 29 gün olur.",
    ),
    ("Həftənin günlərini sırala.", "Bazar ertəsi, çərşənbə axşamı, çərşənbə, cümə axşamı, cümə, şənbə və bazar."),
    (
        "Elektron poçtu necə rəsmi bitirmək olar?",
        "Rəsmi məktubu «Hörmətlə,» sözü ilə bitirib altında adını, soyadını və vəzifəni yaza bilərsən.",
    ),
    (
        "Yeni ili necə təbrik edim?",
        "«Yeni iliniz mübarək! Qarşıdakı il sizə sağlamlıq, sevinc və uğur "
        "gətirsin.» Bu qısa təbriki dostlarına və iş yoldaşlarına göndərə bilərsən.",
    ),
    (
        "Bitkilərimi nə qədər tez-tez sulamalıyam?",
        "Bu bitkinin növündən asılıdır. Ümumi qayda belədir: "
        "torpağın üst qatı quruyanda sula. Kaktuslar az, otaq gülləri isə həftədə bir-iki dəfə su istəyir.",
    ),
    (
        "Bakının havası niyə küləkli olur?",
        "Bakı Abşeron yarımadasında, dəniz sahilində yerləşir və açıq "
        "ərazidə olduğu üçün şimal küləkləri, xüsusən xəzri tez-tez əsir. Ona görə Bakını «küləklər şəhəri» "
        "də adlandırırlar.",
    ),
    (
        "Tar hansı alətdir?",
        "Tar simli musiqi alətidir. Azərbaycan tarının ifaçılıq sənəti 2012-ci ildə "
        "UNESCO-nun qeyri-maddi mədəni irs siyahısına daxil edilib.",
    ),
    (
        "Üzeyir Hacıbəyli kimdir?",
        "Üzeyir Hacıbəyli Azərbaycan bəstəkarı və dramaturqudur. O, 1908-ci ildə "
        "Şərqin ilk operası olan «Leyli və Məcnun»u yazıb.",
    ),
    (
        "Xalça toxumaq çətindir?",
        "Bəli, xalça toxumaq səbir və bacarıq tələb edir. Bir xalça bəzən aylarla "
        "toxunur. Azərbaycan xalçaçılıq sənəti də UNESCO-nun siyahısındadır.",
    ),
]

DIALOGUES = [
    [
        (
            "Axşam yeməyinə nə bişirim?",
            "Tez hazırlanan bir şey istəyirsənsə, kükü bişirə bilərsən. Göyərti, yumurta və bir az duz kifayətdir.",
        ),
        (
            "Kükü üçün hansı göyərti lazımdır?",
            "Adətən keşniş, şüyüd, cəfəri və yaşıl soğan götürülür. Bəziləri ispanaq və nanə də əlavə edir.",
        ),
        (
            "Neçə yumurta qatım?",
            "Bir dəstə göyərti üçün üç-dörd yumurta bəsdir. Kütlə qatı olsun ki, kükü yaxşı bişsin.",
        ),
    ],
    [
        (
            "Bakıya ilk dəfə gəlirəm. Harada gəzim?",
            "İçərişəhərdən başla: Qız qalası və Şirvanşahlar sarayı "
            "oradadır. Sonra dənizkənarı bulvarda gəzə bilərsən.",
        ),
        (
            "Axşam nəyə baxmaq olar?",
            "Axşam Dağüstü parka qalx: oradan bütün şəhər və Alov qüllələrinin işıqları görünür.",
        ),
        (
            "Şəhər kənarına getməyə dəyər?",
            "Bəli, Qobustan qayaüstü təsvirlərinə və Yanardağa baxmağa dəyər. Hər ikisi Bakıdan bir saatlıq yoldadır.",
        ),
    ],
    [
        (
            "Riyaziyyatdan kömək lazımdır. Faiz necə hesablanır?",
            "Bir ədədin faizini tapmaq üçün onu faizə "
            "vurub yüzə bölürsən. Məsələn, 200-ün 15 faizi: 200 × 15 / 100 = 30.",
        ),
        ("Bəs 80-in 25 faizi?", "80 × 25 / 100 = 20. Deməli, 80-in 25 faizi 20-dir."),
        ("Sağ ol, indi başa düşdüm.", "Dəyməz! Başqa sualın olsa, yenə yaz."),
    ],
    [
        (
            "Mənə bir kitab məsləhət gör.",
            "Azərbaycan ədəbiyyatından başlamaq istəsən, Cəlil Məmmədquluzadənin "
            "hekayələrini oxu. Qısa, maraqlı və düşündürücüdür.",
        ),
        (
            "Başqa nə oxuya bilərəm?",
            "Mirzə Fətəli Axundzadənin komediyaları və Sabir Əhmədlinin romanları da yaxşı seçimdir.",
        ),
    ],
    [
        (
            "Telefonumda internet işləmir.",
            "Əvvəlcə mobil internetin açıq olduğunu və balansını yoxla. Sonra təyyarə rejimini bir dəfə açıb bağla.",
        ),
        (
            "Yenə işləmir.",
            "Telefonu yenidən başlat. Kömək etməsə, şəbəkə parametrlərini sıfırla və ya operatorun "
            "qaynar xəttinə zəng et.",
        ),
        ("Oldu, işlədi!", "Çox gözəl! Başqa problem olsa, xəbər ver."),
    ],
    [
        (
            "Sabah iş müsahibəm var. Həyəcanlıyam.",
            "Bu tamamilə normaldır. Şirkət haqqında əvvəlcədən oxu və özün haqqında qısa təqdimat hazırla.",
        ),
        (
            "Hansı suallar verə bilərlər?",
            "Adətən güclü və zəif cəhətlərini, əvvəlki iş təcrübəni və niyə bu "
            "işi seçdiyini soruşurlar. Cavablarını əvvəlcədən səsli məşq et.",
        ),
        ("Nə geyinim?", "Səliqəli və sadə geyim seç. Şirkətin üslubu rəsmidirsə, kostyum daha uyğundur."),
    ],
    [
        ("«Salam» sözü ingiliscə necədir?", "«Salam» ingiliscə «hello» və ya «hi» deməkdir."),
        ("Bəs «sağ ol»?", "«Sağ ol» ingiliscə «thank you» və ya qısaca «thanks» deməkdir."),
        ("«Görüşənədək» necə deyilir?", "«Görüşənədək» ingiliscə «see you» və ya «goodbye» deməkdir."),
    ],
    [
        (
            "Bağımda pomidor yarpaqları saralır.",
            "Bu çox sulamadan və ya torpaqda azot çatışmazlığından ola "
            "bilər. Torpağın həddindən artıq yaş olmadığını yoxla.",
        ),
        (
            "Gübrə verməliyəm?",
            "Bəli, azotlu üzvi gübrə, məsələn, çürümüş peyin kömək edər. Amma çox verməmək lazımdır.",
        ),
    ],
    [
        (
            "Uşağım riyaziyyatı sevmir.",
            "Riyaziyyatı oyunla bağla: mağazada pulu birlikdə sayın, yemək bişirərkən ölçüləri hesablayın.",
        ),
        ("Hansı oyunlar var?", "Domino, nərd və kartlarla sayma oyunları yaxşıdır. Həm əyləncəli, həm də faydalıdır."),
    ],
    [
        (
            "Mənə qısa bir hekayə danış.",
            "Bir kənddə qoca bir bağban yaşayırdı. Hər səhər ağaclarına su verir, "
            "onlarla danışardı. Bir gün kənd uşaqları soruşdu: «Baba, ağaclar səni eşidir?» Qoca gülümsədi: "
            "«Bax, hamısı bar verib. Deməli, eşidir.»",
        ),
        (
            "Hekayənin mənası nədir?",
            "Hekayə qayğının və zəhmətin bəhrə verdiyini göstərir. Nəyə diqqət yetirsən, o da böyüyür.",
        ),
    ],
    [
        (
            "Kompüterdə faylı necə arxivləşdirim?",
            "Faylın üzərinə sağ düymə ilə bas və «Sıxılmış qovluğa göndər» və ya «Arxivə əlavə et» seçimini et.",
        ),
        (
            "Arxivi parolla qorumaq olar?",
            "Bəli, arxivləşdirmə proqramlarının çoxunda parol qoymaq imkanı var. "
            "Arxiv yaradarkən «Parol təyin et» bölməsini tap.",
        ),
    ],
    [
        (
            "Hava proqnozuna görə sabah yağış yağacaq?",
            "Mənim real vaxtda hava məlumatına çıxışım yoxdur. "
            "Dəqiq proqnoz üçün Milli Hidrometeorologiya Xidmətinin saytına və ya telefonundakı hava tətbiqinə "
            "bax.",
        ),
        (
            "Yaxşı, bəs çətir götürüm?",
            "Proqnozda yağış ehtimalı varsa, kiçik çətir götürmək pis olmaz. Yüngül olsa, çantanda çox yer tutmaz.",
        ),
    ],
    [
        ("Ağrıyan başım üçün nə edim?", "Su iç, bir az dincəl və ekrandan uzaq dur. Təmiz hava da kömək edə bilər."),
        (
            "Dərman içim?",
            "Dərmanı həkim və ya əczaçı ilə məsləhətləşib iç. Baş ağrısı tez-tez təkrarlanırsa, "
            "həkimə müraciət etmək vacibdir.",
        ),
    ],
    [
        (
            "Ad günü üçün tort resepti lazımdır.",
            "Sadə biskvit tortu hazırla: dörd yumurtanı bir stəkan şəkərlə "
            "çal, bir stəkan un əlavə et və 180 dərəcədə otuz dəqiqə bişir.",
        ),
        ("Krem necə edim?", "Qaymağı şəkər tozu ilə çal, içinə bir az vanil qat. Biskvitin arasına krem və meyvə düz."),
        ("Neçə nəfərə bəs edər?", "Bu ölçü təxminən altı-səkkiz nəfərə bəs edər."),
    ],
]

COUNTRIES = [
    ("Azərbaycanın", "Bakı"),
    ("Türkiyənin", "Ankara"),
    ("Gürcüstanın", "Tbilisi"),
    ("Qazaxıstanın", "Astana"),
    ("Özbəkistanın", "Daşkənd"),
    ("Almaniyanın", "Berlin"),
    ("Fransanın", "Paris"),
    ("İtaliyanın", "Roma"),
    ("İspaniyanın", "Madrid"),
    ("Yaponiyanın", "Tokio"),
    ("Çinin", "Pekin"),
    ("Misirin", "Qahirə"),
    ("Kanadanın", "Ottava"),
    ("Norveçin", "Oslo"),
    ("Polşanın", "Varşava"),
    ("Macarıstanın", "Budapeşt"),
    ("İranın", "Tehran"),
    ("Ukraynanın", "Kiyev"),
    ("Finlandiyanın", "Helsinki"),
    ("Yunanıstanın", "Afina"),
]

WORDS = [
    ("book", "kitab"),
    ("water", "su"),
    ("house", "ev"),
    ("friend", "dost"),
    ("school", "məktəb"),
    ("city", "şəhər"),
    ("tree", "ağac"),
    ("sun", "günəş"),
    ("bread", "çörək"),
    ("apple", "alma"),
    ("sea", "dəniz"),
    ("mountain", "dağ"),
    ("road", "yol"),
    ("heart", "ürək"),
    ("child", "uşaq"),
    ("flower", "gül"),
    ("teacher", "müəllim"),
    ("window", "pəncərə"),
    ("village", "kənd"),
    ("work", "iş"),
]


def capitals(rng):
    out = []
    for gen, cap in COUNTRIES:
        q = rng.choice(
            [
                f"{gen} paytaxtı haradır?",
                f"{gen} paytaxtı hansı şəhərdir?",
                f"Zəhmət olmasa de, {gen} paytaxtı necə adlanır?",
            ]
        )
        a = rng.choice([f"{gen} paytaxtı {cap} şəhəridir.", f"{cap}. Bu şəhər {gen} paytaxtıdır."])
        out.append([(q, a)])
    return out


def arithmetic(rng, n):
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["+", "-", "×"])
        r = a + b if op == "+" else a - b if op == "-" else a * b
        q = rng.choice([f"Hesabla: {a} {op} {b}", f"{a} {op} {b} neçə edir?", f"Zəhmət olmasa, {a} {op} {b} hesabla."])
        out.append([(q, f"{a} {op} {b} = {r}.")])
    return out


def translations(rng):
    out = []
    for en, az in WORDS:
        q = rng.choice([f"«{en}» sözü azərbaycanca necədir?", f"İngiliscə «{en}» sözünü tərcümə et."])
        out.append([(q, f"«{en.capitalize()}» sözü azərbaycan dilində «{az}» deməkdir.")])
    return out


def to_record(turns, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for q, a in turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": msgs}


def main():
    rng = random.Random(2024)
    convs = [[qa] for qa in QA] + DIALOGUES + capitals(rng) + translations(rng)
    # Follow-up pairs: two unrelated questions in one chat, as users do.
    for _ in range(30):
        a, b = rng.sample(QA, 2)
        convs.append([a, b])
    records = [to_record(t, rng.choice(SYSTEMS) if rng.random() < 0.35 else None) for t in convs]
    records += [to_record(t, TEACHER if rng.random() < 0.5 else None) for t in arithmetic(rng, 40)]
    rng.shuffle(records)
    n_val = max(len(records) // 10, 8)
    here = os.path.dirname(os.path.abspath(__file__))
    for name, part in (("az_chat.jsonl", records[n_val:]), ("az_chat_val.jsonl", records[:n_val])):
        with open(os.path.join(here, name), "w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"train {len(records) - n_val}  val {n_val}")


if __name__ == "__main__":
    main()
